"""Server configuration from, in rising precedence: defaults, a YAML file, environment, flags.

Every option has one name in each source: ``--max-lora-rank`` / ``TINSMITH_MAX_LORA_RANK`` /
``max_lora_rank:`` in YAML. List options (``base_model``, ``model_alias``) take a
comma-separated string in the environment and a list in YAML.
"""

from __future__ import annotations

import argparse
import os
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
    train_micro_batch_size: int | None = None  # sequences per micro-batch (None: by tokens only)
    train_micro_batch_tokens: int | None = None  # None: automatic
    gradient_checkpointing: bool = False
    model_alias: list[str] = field(default_factory=list)  # NAME=ID_OR_DIR
    api_keys_file: str | None = None
    device: str | None = None  # default: cuda if available, else cpu
    max_full_finetunes: int = 1
    max_body_bytes: int = 256 * 1024 * 1024
    long_poll_seconds: float = 25.0
    checkpoint_quota_bytes: int | None = None  # per API key
    public_url: str | None = None  # base URL clients reach this server at (download links)
    log_level: str = "info"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{Path(self.data_dir).resolve() / 'tinsmith.sqlite'}"

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.data_dir) / "checkpoints").resolve()

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
    "train_micro_batch_size": "sequences per training micro-batch (default: bounded by tokens only)",
    "train_micro_batch_tokens": "padded tokens per training micro-batch (default: automatic)",
    "gradient_checkpointing": "recompute layer activations in backward to save memory",
    "model_alias": "NAME=ID_OR_DIR: serve a hub name from a local model (repeatable)",
    "api_keys_file": "file of accepted API keys, one per line (default: any tml- key, single-user mode)",
    "device": "torch device (default: cuda when available, else cpu)",
    "max_full_finetunes": "full fine-tuning runs held at once (each is a private model copy)",
    "max_body_bytes": "largest request body accepted",
    "long_poll_seconds": "how long retrieve_future waits before answering try_again",
    "checkpoint_quota_bytes": "checkpoint storage allowed per API key (default: unlimited)",
    "public_url": "URL clients reach this server at, for download links (default: the request's own URL)",
    "log_level": "debug, info, warning or error",
}


def _coerce(f, value: Any) -> Any:
    """Convert a YAML or environment value to the field's type."""
    if value is None:
        return None
    default = f.default if f.default is not dataclass_missing() else None
    if f.name in ("base_model", "model_alias"):
        if isinstance(value, str):
            return [v for v in (s.strip() for s in value.split(",")) if v]
        return [str(v) for v in value]
    if isinstance(default, bool) or f.name == "gradient_checkpointing":
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    if f.name in ("port", "max_lora_adapters", "max_lora_rank", "train_micro_batch_tokens",
                  "max_full_finetunes", "max_body_bytes", "train_micro_batch_size", "checkpoint_quota_bytes",
                  "max_training_runs"):
        return int(value)
    if f.name in ("long_poll_seconds", "session_timeout_s"):
        return float(value)
    return str(value)


def dataclass_missing():
    from dataclasses import MISSING

    return MISSING


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any of the options below (underscored names)")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "gradient_checkpointing":
            p.add_argument(flag, action="store_true", default=None, help=_HELP[f.name])
        elif f.name in ("base_model", "model_alias"):
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
            setattr(out, f.name, _coerce(f, values[f.name]))
    return out
