"""Server configuration from, in rising precedence: defaults, a YAML file, environment, flags.

Every option has one name in each source: ``--max-lora-rank`` / ``TINSMITH_MAX_LORA_RANK`` /
``max_lora_rank:`` in YAML. List options (``base_model``, ``model_alias``) take a
comma-separated string in the environment and a list in YAML.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "TINSMITH_"


@dataclass
class ServerConfig:
    base_model: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "./data"
    database_url: str | None = None  # default: SQLite file under data_dir
    checkpoint_dir: str | None = None  # default: data_dir/checkpoints
    max_lora_adapters: int = 16
    max_lora_rank: int = 128
    max_training_runs: int = 256
    session_timeout_s: float = 300.0
    request_retention_s: float = 86400.0  # 0: keep payloads and results forever
    train_micro_batch_size: int | None = None  # sequences per micro-batch (None: by tokens only)
    train_micro_batch_tokens: int | None = None  # None: automatic
    train_chunk_tokens: int | None = None  # None: a micro-batch for one key, half of one when keys share
    gradient_checkpointing: bool = False
    model_alias: list[str] = field(default_factory=list)  # NAME=ID_OR_DIR
    api_keys_file: str | None = None
    device: str | None = None  # default: cuda if available, else cpu
    max_full_finetunes: int = 1
    max_full_sampler_snapshots: int = 1  # frozen full-model copies that samplers of full fine-tunes read
    max_body_bytes: int = 256 * 1024 * 1024
    max_num_samples: int | None = None  # default: the sampler's row limit
    max_sample_tokens: int | None = None  # default: the model's context length
    max_prompt_tokens: int | None = None  # default: the model's context length
    max_forward_datums: int = 1024
    max_forward_tokens: int = 1 << 21
    max_image_pixels: int = 4096 * 4096  # width x height of one prompt image, read before decoding
    long_poll_seconds: float = 25.0
    seq_gap_wait_s: float = 2.0  # how long a run's request waits for an earlier seq_id to arrive
    checkpoint_quota_bytes: int | None = None  # per API key
    max_runs_per_key: int = 32  # per-key limits apply with --api-keys-file only
    max_requests_in_flight_per_key: int = 1024
    max_sampler_snapshots: int = 64
    max_sampler_snapshots_per_key: int = 32
    sampler_snapshot_idle_s: float = 120.0
    public_url: str | None = None  # base URL clients reach this server at (download links)
    log_level: str = "info"
    log_format: str = "text"  # text | json (one JSON object per line, for log collectors)
    metrics_auth: bool = False  # require an API key on /metrics

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{Path(self.data_dir).resolve() / 'tinsmith.sqlite'}"

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.data_dir) / "checkpoints").resolve()

    # Options that must be a positive count when set, and durations that must not be negative.
    _AT_LEAST_ONE = ("max_lora_adapters", "max_lora_rank", "max_training_runs", "max_full_finetunes",
                     "max_full_sampler_snapshots",
                     "max_body_bytes", "max_forward_datums", "max_forward_tokens", "max_image_pixels",
                     "train_micro_batch_tokens",
                     "train_micro_batch_size", "train_chunk_tokens", "max_num_samples", "max_sample_tokens",
                     "max_prompt_tokens", "max_runs_per_key", "max_requests_in_flight_per_key",
                     "max_sampler_snapshots", "max_sampler_snapshots_per_key")
    _NOT_NEGATIVE = ("request_retention_s", "seq_gap_wait_s", "sampler_snapshot_idle_s", "checkpoint_quota_bytes")
    _POSITIVE = ("session_timeout_s", "long_poll_seconds")

    def validate(self) -> None:
        """Refuse values that cannot work, naming the option (a ValueError the CLI prints as one line)."""
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be between 1 and 65535 (got {self.port})")
        for name in self._AT_LEAST_ONE:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        for name in self._NOT_NEGATIVE:
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative (got {getattr(self, name)})")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"--log-format must be text or json (got {self.log_format!r})")
        for name in self._POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be above 0 (got {getattr(self, name)})")

    def aliases(self) -> dict[str, str]:
        out = {}
        for item in self.model_alias:
            if "=" not in item:
                raise ValueError(f"--model-alias {item!r} must look like NAME=ID_OR_DIR")
            name, target = item.split("=", 1)
            out[name.strip()] = target.strip()
        return out


_HELP = {
    "base_model": "base model to serve: HF id or local directory (repeat for several)",
    "host": "interface to listen on",
    "port": "port to listen on",
    "data_dir": "where the default SQLite database and checkpoints live",
    "database_url": "SQLAlchemy URL, e.g. postgresql+psycopg://user@host:5432/db (default: SQLite in --data-dir)",
    "checkpoint_dir": "where checkpoints are written (default: DATA_DIR/checkpoints)",
    "max_lora_adapters": "LoRA adapter slots per base model",
    "max_lora_rank": "largest LoRA rank a client may ask for",
    "max_training_runs": "training runs held per base model (beyond --max-lora-adapters, idle ones wait in host memory)",
    "session_timeout_s": "a session with no heartbeat for this long is finished and its runs unloaded",
    "request_retention_s": "seconds a finished request's payload and result are kept; the record stays and "
                           "retrieving the result later answers 410 (0: keep forever)",
    "train_micro_batch_size": "sequences per training micro-batch (default: bounded by tokens only)",
    "train_micro_batch_tokens": "padded tokens per training micro-batch (default: automatic)",
    "train_chunk_tokens": "forward/backward tokens run between scheduling decisions, shared among API keys "
                          "(default: one micro-batch while one key has work, half of one while several do); "
                          "smaller answers other keys sooner, larger switches less",
    "gradient_checkpointing": "recompute layer activations in backward to save memory",
    "model_alias": "NAME=ID_OR_DIR: serve a hub name from a local model (repeatable)",
    "api_keys_file": "file of accepted API keys, one per line, '#' comments; re-read when it changes or on "
                     "SIGHUP (default: any tml- key, single-user mode)",
    "device": "torch device (default: cuda when available, else cpu)",
    "max_full_finetunes": "full fine-tuning runs held at once (each is a private model copy)",
    "max_full_sampler_snapshots": "sampler snapshots of full fine-tunes held at once (each is a frozen copy of "
                                  "the whole model in device memory; counted in the snapshot limits too)",
    "max_body_bytes": "largest request body accepted, before and after decompression",
    "max_num_samples": "largest num_samples of a sampling request, and rows the sampler decodes at once (default: 256)",
    "max_sample_tokens": "largest sampling_params.max_tokens (default: the model's context length)",
    "max_prompt_tokens": "longest sampling prompt, in tokens (default: the model's context length)",
    "max_forward_datums": "most datums in one forward_backward/forward request (the SDK splits larger calls)",
    "max_forward_tokens": "most model_input tokens, all datums together, in one forward_backward/forward request",
    "max_image_pixels": "largest image (width x height) in a model input, checked from its header before it is decoded",
    "long_poll_seconds": "how long retrieve_future waits before answering try_again",
    "seq_gap_wait_s": "how long a run's request waits for a missing earlier seq_id before it runs anyway",
    "checkpoint_quota_bytes": "checkpoint storage allowed per API key, counting every save and copy (default: unlimited)",
    "max_runs_per_key": "training runs one API key may hold at once (with --api-keys-file)",
    "max_requests_in_flight_per_key": "queued and running requests per API key; more get a 429 that the SDK retries "
                                      "(with --api-keys-file)",
    "max_sampler_snapshots": "sampler snapshots held in memory by the whole server; idle ones are evicted to make room",
    "max_sampler_snapshots_per_key": "sampler snapshots one API key may hold in memory; its own idle ones make room "
                                     "(with --api-keys-file)",
    "sampler_snapshot_idle_s": "a snapshot unused for this long (and with no queued or running request) is idle: "
                               "another key's new snapshot may evict it",
    "public_url": "URL clients reach this server at, for download links (default: the request's own URL)",
    "log_level": "debug, info, warning or error",
    "log_format": "text (for people) or json (one object per line, for log collectors)",
    "metrics_auth": "require an API key (X-API-Key, or Authorization: Bearer) on /metrics (default: open to "
                    "anyone who can reach the server's address)",
}


def _field_type(f) -> type:
    """The scalar type of an option (``int`` for ``int | None``, ``list`` for list options)."""
    hint = typing.get_type_hints(ServerConfig)[f.name]
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _coerce(f, value: Any) -> Any:
    """Convert a YAML or environment value to the field's type."""
    if value is None:
        return None
    kind = _field_type(f)
    if kind is list:
        if isinstance(value, str):
            return [v for v in (s.strip() for s in value.split(",")) if v]
        return [str(v) for v in value]
    if kind is bool:
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    if kind is int:
        return int(value)
    if kind is float:
        return float(value)
    return str(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any of the options below (underscored names)")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        if _field_type(f) is bool:
            p.add_argument(flag, action="store_true", default=None, help=_HELP[f.name])
        elif _field_type(f) is list:
            p.add_argument(flag, action="append", default=None, help=_HELP[f.name])
        else:
            p.add_argument(flag, default=None, help=_HELP[f.name])


def load_config(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    environ = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        raw = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file}: expected a mapping of option names to values")
        known = {f.name for f in fields(ServerConfig)}
        unknown = sorted(set(k.replace("-", "_") for k in raw) - known)
        if unknown:
            raise ValueError(f"{config_file}: unknown options {unknown}")
        values.update({k.replace("-", "_"): v for k, v in raw.items()})
    for f in fields(ServerConfig):
        env = environ.get(ENV_PREFIX + f.name.upper())
        if env is not None and env != "":
            values[f.name] = env
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    out = ServerConfig()
    for f in fields(ServerConfig):
        if f.name in values:
            try:
                setattr(out, f.name, _coerce(f, values[f.name]))
            except ValueError:
                raise ValueError(f"--{f.name.replace('_', '-')} must be {_field_type(f).__name__}, "
                                 f"got {values[f.name]!r}") from None
    out.validate()
    return out
