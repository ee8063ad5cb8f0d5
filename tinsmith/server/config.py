"""Server configuration from, in rising precedence: defaults, a YAML file, environment, flags.

Every option has one name in each source: ``--max-lora-rank`` / ``TINSMITH_MAX_LORA_RANK`` /
``max_lora_rank:`` in YAML. List options (``base_model``, ``model_alias``) take a
comma-separated string in the environment and a list in YAML.

The sources are read with pydantic-settings and the values checked by pydantic against the
field types below (ranges included), so a bad value is refused in one line that names the
option the way the user wrote it (``--port``, ``TINSMITH_PORT`` or ``port`` in the YAML file).
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BeforeValidator, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict, YamlConfigSettingsSource

ENV_PREFIX = "TINSMITH_"


def _split_commas(value: Any) -> Any:
    """A list option given as one string (the environment): comma-separated items."""
    if isinstance(value, str):
        return [item for item in (s.strip() for s in value.split(",")) if item]
    return value


# Option types: the range each kind of option must lie in, checked by pydantic.
AtLeastOne = Annotated[int, annotated_types.Ge(1)]  # a count or size that must be positive
NotNegativeInt = Annotated[int, annotated_types.Ge(0)]
NotNegative = Annotated[float, annotated_types.Ge(0)]  # durations where 0 means "at once" or "forever"
AboveZero = Annotated[float, annotated_types.Gt(0)]
Fraction = Annotated[float, annotated_types.Gt(0), annotated_types.Le(1)]  # a share of something, above 0
Port = Annotated[int, annotated_types.Ge(1), annotated_types.Le(65535)]
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]
# Choices are matched without regard to case: ``--log-level INFO`` is ``info``.
_LOWERED = BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)
LogLevel = Annotated[Literal["debug", "info", "warning", "error"], _LOWERED]
Dtype = Annotated[Literal["auto", "bfloat16", "float16", "float32"], _LOWERED]
KvLayout = Annotated[Literal["auto", "paged", "rows"], _LOWERED]
Switch = Annotated[Literal["auto", "on", "off"], _LOWERED]
LogFormat = Annotated[Literal["text", "json"], _LOWERED]
ClientTransport = Annotated[Literal["httpx", "pyqwest"], _LOWERED]
RayStrategy = Annotated[Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                        BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]


class ServerConfig(BaseSettings):
    """Every server option. Built from code it takes exactly the values passed (no environment);
    ``load_config`` layers the YAML file, the environment and the flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid")

    base_model: CommaList = []
    host: str = "127.0.0.1"
    port: Port = 8000
    data_dir: str = "./data"
    database_url: str | None = None  # default: SQLite file under data_dir
    checkpoint_dir: str | None = None  # default: data_dir/checkpoints
    max_lora_adapters: AtLeastOne = 16
    max_lora_rank: AtLeastOne = 128
    max_training_runs: AtLeastOne = 256
    session_timeout_s: AboveZero = 300.0
    request_retention_s: NotNegative = 86400.0  # 0: keep payloads and results forever
    metric_history_points: Annotated[int, annotated_types.Ge(2)] = 2000  # a run's points kept before the older half is thinned
    train_micro_batch_size: AtLeastOne | None = None  # sequences per micro-batch (None: by tokens only)
    train_micro_batch_tokens: AtLeastOne | None = None  # None: automatic
    train_chunk_tokens: AtLeastOne | None = None  # None: a micro-batch for one key, half of one when keys share
    train_packing: Switch = "auto"  # packed (padding-free) training micro-batches; auto: see worker.service
    gradient_checkpointing: bool = False
    warm_up: bool = True  # sample and train each base model once before reporting ready
    model_alias: CommaList = []  # NAME=ID_OR_DIR
    api_keys_file: str | None = None
    device: str | None = None  # default: cuda if available, else cpu
    dtype: Dtype = "auto"  # base weights and activations; auto: bfloat16 on CUDA, float32 on CPU
    device_memory_fraction: Fraction = 1.0  # of each GPU's memory this process's allocator may reserve
    tensor_parallel_size: AtLeastOne = 1  # ranks (GPUs) every base model is sharded over; 1: no process group
    data_parallel_size: AtLeastOne = 1  # ranks (GPUs) every base model is replicated on; 1: no process group
    ray_address: str | None = None  # None: the other ranks are local processes; auto or HOST:PORT: Ray actors
    ray_placement_strategy: RayStrategy = "STRICT_PACK"  # of the ranks' placement group
    max_full_finetunes: AtLeastOne = 1
    max_full_sampler_snapshots: AtLeastOne = 4  # frozen full-model copies (host memory) that full fine-tunes' samplers read
    resident_full_sampler_snapshots: AtLeastOne = 1  # of those, how many are on the device at once
    max_snapshot_host_bytes: NotNegativeInt | None = None  # host memory of full snapshots, whole server
    max_snapshot_host_bytes_per_key: NotNegativeInt | None = None  # the same per API key (with --api-keys-file)
    max_body_bytes: AtLeastOne = 256 * 1024 * 1024
    max_num_samples: AtLeastOne | None = None  # default: the sampler's row limit
    max_sample_tokens: AtLeastOne | None = None  # default: the model's context length
    prefix_cache_bytes: NotNegativeInt = 1 << 30  # prompt K/V kept across sample requests, per sampler (0: off)
    sampler_kv_cache_bytes: NotNegativeInt | None = None  # None: unlimited on CPU, 40% of free memory on CUDA
    sampler_cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA only)
    sampler_run_ahead: bool = True  # queue each decode burst before the last one's tokens are read (CUDA only)
    dependent_launches: bool = True  # Triton kernels scheduled while the kernel before ends (Hopper and newer)
    sampler_kv_cache_layout: KvLayout = "auto"  # auto: paged on CUDA, per-row buffers on CPU
    sampler_prefill_chunk_tokens: NotNegativeInt | None = None  # None: 2048 on CUDA, 512 on CPU; 0: whole prompts
    max_prompt_tokens: AtLeastOne | None = None  # default: the model's context length
    max_forward_datums: AtLeastOne = 1024
    max_forward_tokens: AtLeastOne = 1 << 21
    max_image_pixels: AtLeastOne = 4096 * 4096  # width x height of one prompt image, read before decoding
    long_poll_seconds: AboveZero = 25.0
    seq_gap_wait_s: NotNegative = 2.0  # how long a run's request waits for an earlier seq_id to arrive
    checkpoint_quota_bytes: NotNegativeInt | None = None  # per API key
    max_runs_per_key: AtLeastOne = 32  # per-key limits apply with --api-keys-file only
    max_requests_in_flight_per_key: AtLeastOne = 1024
    max_requests_per_second_per_key: NotNegative = 512.0  # 0: no rate limit
    request_burst_per_key: AtLeastOne = 8192
    max_sampler_snapshots: AtLeastOne = 64
    max_sampler_snapshots_per_key: AtLeastOne = 32
    sampler_snapshot_idle_s: NotNegative = 120.0
    custom_loss_client_side: bool = False  # do not offer server-side custom losses
    custom_loss_max_nodes: AtLeastOne = 1024
    custom_loss_max_elements: AtLeastOne = 1 << 24  # per tensor a custom loss makes
    custom_loss_timeout_s: AboveZero = 10.0  # all runs of the loss for one request
    custom_loss_max_per_session: AtLeastOne = 64
    # The HTTP transport the SDK is told to use (client/config): see docs/compatibility.md.
    client_http_transport: ClientTransport = "httpx"
    public_url: str | None = None  # base URL clients reach this server at (download links)
    usage_flush_s: AboveZero = 10.0  # how often per-key token counts are written to the database
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"  # text | json (one JSON object per line, for log collectors)
    metrics_auth: bool = False  # require an API key on /metrics

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError.of(e, flag_name) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Only what the caller passes: ``load_config`` reads the file and the environment itself,
        # so that an error can say which of them a bad value came from.
        return (init_settings,)

    @property
    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{Path(self.data_dir).resolve() / 'tinsmith.sqlite'}"

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.data_dir) / "checkpoints").resolve()

    def validate(self) -> None:
        """Check again after fields were assigned (construction already checks): a one-line ``ConfigError``."""
        ServerConfig(**self.model_dump())

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
    "metric_history_points": "metric points (loss and friends, one per forward_backward/optim_step) kept per run "
                             "for the dashboard; beyond it the older half is thinned to every other point",
    "train_micro_batch_size": "sequences per training micro-batch (default: bounded by tokens only)",
    "train_micro_batch_tokens": "tokens per training micro-batch, padded (real ones when packed) (default: automatic)",
    "train_chunk_tokens": "forward/backward tokens run between scheduling decisions, shared among API keys "
                          "(default: one micro-batch while one key has work, half of one while several do); "
                          "smaller answers other keys sooner, larger switches less",
    "train_packing": "auto, on or off: pack a training micro-batch's sequences end to end in one row, attending "
                     "per document, so padding costs nothing and micro-batches are bounded by real tokens (auto: "
                     "on; image-text models always keep padded rows)",
    "gradient_checkpointing": "recompute layer activations in backward to save memory",
    "warm_up": "sample and train each base model once at start-up, so the first request is not the slow one",
    "model_alias": "NAME=ID_OR_DIR: serve a hub name from a local model (repeatable)",
    "api_keys_file": "file of accepted API keys, one per line, '#' comments; re-read when it changes or on "
                     "SIGHUP (default: any tml- key, single-user mode)",
    "device": "torch device (default: cuda when available, else cpu)",
    "tensor_parallel_size": "shard every base model over this many ranks, one GPU each (cuda:0..N-1; on the CPU, "
                            "processes): every family served (experts split over the ranks); a full fine-tune runs as "
                            "FSDP2 over the ranks; 1 runs one process",
    "data_parallel_size": "replicate every base model on this many ranks, one GPU each (cuda:0..M-1; on the CPU, "
                          "processes): each chunk of LoRA training is split between the replicas (gradients summed "
                          "before each step) and each sample request runs on one; full fine-tunes are sharded over "
                          "them (FSDP2); with --tensor-parallel-size N each replica is sharded over N ranks "
                          "(M x N in all); 1 runs one process",
    "ray_address": "place the tensor-parallel ranks other than this process's rank 0 as Ray actors on the Ray "
                   "cluster at this address (auto: the one `ray start` runs on this node; HOST:PORT: its head), so "
                   "they may run on other machines; needs `pip install 'tinsmith[ray]'` (default: local processes)",
    "ray_placement_strategy": "Ray placement strategy of the ranks (one bundle each, rank 0's on this node): "
                              "STRICT_PACK keeps every rank on this node; PACK, SPREAD or STRICT_SPREAD let them "
                              "go to other nodes",
    "dtype": "precision of the base weights and activations: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, "
             "float16 or float32; logprobs are computed in float32 either way, and full fine-tunes of "
             "half-precision weights keep float32 master weights",
    "max_full_finetunes": "full fine-tuning runs held at once (each is a private model copy)",
    "max_full_sampler_snapshots": "sampler snapshots of full fine-tunes held at once (each is a frozen copy of "
                                  "the whole model in host memory; counted in the snapshot limits too)",
    "resident_full_sampler_snapshots": "sampler snapshots of full fine-tunes on the device at once (each a whole-model "
                                       "copy); others wait in host memory and are brought over when sampled, least "
                                       "recently used offloaded first",
    "max_snapshot_host_bytes": "host memory all sampler snapshots of full fine-tunes may take together "
                               "(default: unlimited; --max-full-sampler-snapshots still caps their number)",
    "max_snapshot_host_bytes_per_key": "host memory one API key's sampler snapshots of full fine-tunes may take "
                                       "(with --api-keys-file; default: unlimited)",
    "max_body_bytes": "largest request body accepted, before and after decompression",
    "max_num_samples": "largest num_samples of a sampling request, and rows the sampler decodes at once (default: 256)",
    "max_sample_tokens": "largest sampling_params.max_tokens (default: the model's context length)",
    "prefix_cache_bytes": "device memory each sampler may keep prompts' K/V in, so later requests that start with "
                          "the same tokens (GRPO's copies of one prompt, earlier turns of a conversation) skip "
                          "their prefill; least recently used blocks are evicted (0: off). With paged K/V (GPUs) "
                          "the blocks are pages of the K/V cache, within --sampler-kv-cache-bytes too: running "
                          "sequences take them back when they need the room",
    "sampler_kv_cache_bytes": "device memory the K/V of each sampler's running sequences may take; requests are "
                              "admitted by what their rows hold and wait for room beyond it, and when running rows "
                              "outgrow it the newest request is preempted and resumes later (default: unlimited "
                              "on CPU; on CUDA 40% of the device memory free when the sampler starts)",
    "sampler_cuda_graphs": "replay each sampler's decode steps from CUDA graphs captured per batch-size bucket, "
                           "rather than launching every kernel from Python (CUDA only; --no-sampler-cuda-graphs "
                           "decodes eagerly)",
    "sampler_run_ahead": "queue each decode burst before the last one's tokens are read and recorded, so that "
                         "the device decodes while the host records them (CUDA only: a CPU does both in turn; "
                         "tensor-parallel samplers always read first; --no-sampler-run-ahead reads first always)",
    "device_memory_fraction": "share of each GPU's memory this server may take (its allocator's reserve; the CUDA "
                              "context and library workspaces come on top): what sizes training micro-batches and "
                              "the samplers' K/V budgets is the free memory within it, and an allocation beyond it "
                              "fails as on a full device. Leave the rest to another process sharing the GPU "
                              "(default 1.0: no cap)",
    "dependent_launches": "launch the Triton kernels (decode attention, norms, the token choice, the adapters' "
                          "products) dependent on the kernel before (programmatic dependent launch), so that each "
                          "is scheduled while the one before ends; on Hopper and newer GPUs, after a start-up probe "
                          "(--no-dependent-launches launches them one after another, as on older GPUs)",
    "sampler_kv_cache_layout": "how each sampler keeps K/V: paged (one pool of 64-position pages, each sequence "
                               "holding the pages it uses; the decode kernels read them in place) or rows (a "
                               "buffer per sequence as long as the longest one); auto: paged on CUDA, rows on CPU, "
                               "where reading pages costs a copy per step",
    "sampler_prefill_chunk_tokens": "a sampling prompt longer than this is prefilled in chunks of this many tokens, "
                                    "one per scheduler step, so running sequences keep decoding between them "
                                    "(default: 2048 on CUDA, 512 on CPU; 0: whole prompts)",
    "max_prompt_tokens": "longest sampling prompt, in tokens (default: the model's context length)",
    "max_forward_datums": "most datums in one forward_backward/forward request (the SDK splits larger calls)",
    "max_forward_tokens": "most model_input tokens, all datums together, in one forward_backward/forward request",
    "max_image_pixels": "largest image (width x height) in a model input, checked from its header before it is decoded",
    "long_poll_seconds": "how long retrieve_future and retrieve_futures wait before answering with nothing new",
    "seq_gap_wait_s": "how long a run's request waits for a missing earlier seq_id before it runs anyway",
    "checkpoint_quota_bytes": "checkpoint storage allowed per API key, counting every save and copy (default: unlimited)",
    "max_runs_per_key": "training runs one API key may hold at once (with --api-keys-file)",
    "max_requests_in_flight_per_key": "queued and running requests per API key; more get a 429 that the SDK retries "
                                      "(with --api-keys-file)",
    "max_requests_per_second_per_key": "HTTP requests per second one API key may send while other keys are being "
                                       "served (beyond its burst); more get a 429 that the SDK retries; 0: no limit "
                                       "(with --api-keys-file)",
    "request_burst_per_key": "HTTP requests one API key may send at once before its request rate applies "
                             "(with --api-keys-file)",
    "max_sampler_snapshots": "sampler snapshots held in memory by the whole server; idle ones are evicted to make room",
    "max_sampler_snapshots_per_key": "sampler snapshots one API key may hold in memory; its own idle ones make room "
                                     "(with --api-keys-file)",
    "sampler_snapshot_idle_s": "a snapshot unused for this long (and with no queued or running request) is idle: "
                               "another key's new snapshot may evict it",
    "custom_loss_client_side": "do not run custom losses here: the SDK's create_custom_loss keeps them on the client",
    "custom_loss_max_nodes": "most nodes in the graph of a custom loss uploaded with create_custom_loss",
    "custom_loss_max_elements": "most elements of any one tensor a custom loss makes (checked before it is allocated)",
    "custom_loss_timeout_s": "wall-clock limit for all runs of a custom loss for one request together",
    "custom_loss_max_per_session": "custom losses one session may create",
    "client_http_transport": "the SDK's HTTP transport, set through client/config: httpx, or pyqwest (less client "
                             "CPU a request, but a script may abort at exit on Python 3.11-3.13)",
    "public_url": "URL clients reach this server at, for download links (default: the request's own URL)",
    "usage_flush_s": "how often per-key token counts (billing usage) are written to the database; a crash "
                     "loses at most this many seconds of counts",
    "log_level": "debug, info, warning or error",
    "log_format": "text (for people) or json (one object per line, for log collectors)",
    "metrics_auth": "require an API key (X-API-Key, or Authorization: Bearer) on /metrics (default: open to "
                    "anyone who can reach the server's address)",
}


def option_help(option: str) -> str:
    return _HELP[option]


def option_kind(option: str) -> type:
    """The scalar type of an option: ``int`` for ``int | None``, ``list`` for list options."""
    hint = ServerConfig.model_fields[option].annotation
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    hint = typing.get_origin(hint) or hint  # list[str] -> list
    return hint if hint in (int, float, bool, list) else str


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


class ConfigError(ValueError):
    """An option that cannot work, in one line naming it as the user wrote it."""

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.message = message
        self.errors = errors or []

    @classmethod
    def of(cls, error: ValidationError | ConfigError, name_of: Callable[[str], str]) -> ConfigError:
        errors = error.errors() if isinstance(error, ValidationError) else error.errors
        if not errors:
            return error if isinstance(error, ConfigError) else cls(str(error))
        return cls(_describe(errors[0], name_of), errors)


def _bounds(option: str) -> dict[str, Any]:
    """The ``ge``/``gt``/``le`` limits an option's type declares (``int | None`` types included)."""
    field = ServerConfig.model_fields[option]
    metadata = list(field.metadata)  # pydantic moves a plain Annotated type's constraints here
    for arg in getattr(field.annotation, "__args__", ()):  # an optional type keeps them inside
        metadata.extend(getattr(arg, "__metadata__", ()))
    return {key: getattr(m, key) for m in metadata for key in ("ge", "gt", "le") if hasattr(m, key)}


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "list": "a list",
               "string": "a string"}


def _describe(error: dict[str, Any], name_of: Callable[[str], str]) -> str:
    """One line for one pydantic error: the option, what it must be, and what it got."""
    option = str(error["loc"][0]) if error["loc"] else ""
    name, got = name_of(option), error.get("input")
    kind = error["type"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(option, ServerConfig.model_fields, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; `tinsmith serve --help` lists the options"
        return f"unknown option {name}{hint}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal"):
        b = _bounds(option)
        if "ge" in b and "le" in b:
            rule = f"must be between {b['ge']} and {b['le']}"
        elif "gt" in b and "le" in b:
            rule = f"must be above {b['gt']} and at most {b['le']}"
        elif "gt" in b:
            rule = f"must be above {b['gt']}"
        elif b.get("ge") == 0:
            rule = "must not be negative"
        else:
            rule = f"must be at least {b.get('ge')}"
        return f"{name} {rule} (got {got})"
    if kind == "literal_error":
        return f"{name} must be {error['ctx']['expected']} (got {got!r})"
    for type_name, words in _TYPE_WORDS.items():
        if kind.startswith(type_name + "_"):
            return f"{name} must be {words} (got {got!r})"
    return f"{name}: {error['msg']} (got {got!r})"


class _EnvironSource(EnvSettingsSource):
    """``TINSMITH_*`` variables of a given mapping (``os.environ`` by default)."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(ServerConfig)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Names match case-insensitively (as the source looks them up); an empty value is unset.
        return {name.lower(): value for name, value in self._environ.items() if value != ""}


class _YamlSource(YamlConfigSettingsSource):
    """The ``--config`` file; keys may be written with dashes or underscores."""

    def __init__(self, path: Path):
        self.keys_as_written: dict[str, str] = {}
        super().__init__(ServerConfig, yaml_file=path)

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        raw = super()._read_file(file_path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{file_path}: expected a mapping of option names to values, "
                              f"got {type(raw).__name__}")
        out = {}
        for key, value in raw.items():
            option = str(key).replace("-", "_")
            self.keys_as_written[option] = str(key)
            out[option] = value
        return out


def _read_yaml(config_file: str, given_as: str) -> tuple[dict[str, Any], dict[str, str]]:
    path = Path(config_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"{given_as} {config_file}: no such file")
    try:
        source = _YamlSource(path)
    except ConfigError:
        raise
    except Exception as e:  # yaml.YAMLError, UnicodeDecodeError, OSError
        raise ConfigError(f"{given_as} {config_file}: not readable YAML ({_first_line(e)})") from None
    values = dict(source.yaml_data)
    names = {option: f"{source.keys_as_written.get(option, option)} (in {config_file})" for option in values}
    return values, names


def _first_line(e: Exception) -> str:
    """A YAML error's problem and where it is, else the first line of any error."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _given_flags(args: Any) -> dict[str, Any]:
    """Options given on the command line: attributes or keys that are not None (nor empty lists)."""
    if args is None:
        return {}
    items = args.items() if isinstance(args, Mapping) else vars(args).items()
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in items
            if k in ServerConfig.model_fields and v is not None and v != () and v != []}


def load_config(args: Any = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Defaults < YAML file (``--config``/``TINSMITH_CONFIG``) < ``TINSMITH_*`` < flags.

    ``args`` holds the flags: a mapping or an object with one attribute per option (None or
    absent when not given). Raises ``ConfigError`` (a ValueError) whose message is one line.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    if _given(args, "config"):
        values, names = _read_yaml(_given(args, "config"), "--config")
    elif environ.get(ENV_PREFIX + "CONFIG"):
        values, names = _read_yaml(environ[ENV_PREFIX + "CONFIG"], ENV_PREFIX + "CONFIG")
    env_values = _EnvironSource(environ)()
    values.update(env_values)
    names.update({option: env_name(option) for option in env_values})
    flags = _given_flags(args)
    values.update(flags)
    names.update({option: flag_name(option) for option in flags})
    try:
        return ServerConfig(**values)
    except ConfigError as e:
        raise ConfigError.of(e, lambda option: names.get(option, flag_name(option))) from None


def _given(args: Any, key: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(key)
    return getattr(args, key, None)
