"""The server's log: plain text for people, or one JSON object per line for log collectors.

``--log-format text`` (default) writes ``TIME LEVEL LOGGER: message``; ``--log-format json``
writes ``{"time", "level", "logger", "message", ...}``, plus the structured fields a line carries
(a request line: route, method, status, duration_ms, key_id, run, tokens, reason). Both hold
the same information. uvicorn's own lines go through the same handler, so a collector sees one
format. No line carries an API key or a request body; tenants appear as their key id.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from tinsmith.server.state import ServerState

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("tinsmith.server")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; a record's ``fields`` (``extra={"fields": {...}}``) are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Send every logger (tinsmith's and uvicorn's) to stderr in ``fmt`` at ``level``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)} (got {fmt!r})")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # let them reach the root handler
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    # Each request already has its own line (tinsmith.requests); uvicorn's access line would repeat it.
    logging.getLogger("uvicorn.access").disabled = True


def server_url(state: ServerState) -> str:
    c = state.config
    return (c.public_url or f"http://{c.host}:{c.port}").rstrip("/")


def safe_database_url(url: str) -> str:
    """The database URL with any password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: show no part of it
        return "(unparsable database URL)"


def http_stack() -> dict[str, str]:
    """What uvicorn will parse HTTP and run its event loop with (its ``auto`` choices).

    ``httptools`` and ``uvloop`` come with ``uvicorn[standard]``, which tinsmith depends on; an
    image that installed uvicorn alone falls back to h11's pure-Python parser and asyncio's loop.
    Every SDK call pays the parser's cost on the event loop, which takes in GRPO's bursts of
    separate requests: h11 added about a fifth to a cheap request's CPU (docs/performance.md).
    """
    def present(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return {"http": "httptools" if present("httptools") else "h11",
            "loop": "uvloop" if present("uvloop") and sys.platform != "win32" else "asyncio"}


def _warn_of_http_fallbacks(stack: dict[str, str]) -> None:
    missing = [name for name, had in (("httptools", stack["http"] == "httptools"), ("uvloop", stack["loop"] == "uvloop"))
               if not had]
    if missing:
        log.warning("HTTP parsed by %s, event loop %s: %s missing, so every request costs the server more CPU; "
                    "install uvicorn[standard] (tinsmith's own dependency) to get them",
                    stack["http"], stack["loop"], " and ".join(missing), extra={"fields": stack})


def log_startup_summary(state: ServerState) -> None:
    """What this server serves and where: models, devices, memory plan, database, data, URLs."""
    from tinsmith.server.health import read_health

    c, worker = state.config, state.worker
    for name, base in worker.bases.items():
        p = next(base.loaded.model.parameters())
        layout = "packed" if base.lora.packing else "padded"
        log.info("model %s: %s, %.1fM parameters, %s on %s; training micro-batches of %d tokens (%s), %d LoRA "
                 "adapters resident", name, base.config.family, base.config.num_params / 1e6,
                 str(p.dtype).removeprefix("torch."), p.device, base.lora.micro_batch_tokens, layout,
                 base.lora.max_lora_adapters,
                 extra={"fields": {"model": name, "family": base.config.family, "dtype": str(p.dtype),
                                   "device": str(p.device), "micro_batch_tokens": base.lora.micro_batch_tokens,
                                   "train_layout": layout}})
    for alias, target in worker.aliases.items():
        log.info("model %s: alias of %s", alias, target, extra={"fields": {"model": alias, "alias_of": target}})
    health = read_health()
    devices = ", ".join(f"cuda:{d.index} {d.name} ({(d.total_bytes or 0) / 2**30:.0f} GiB)" for d in health.devices)
    log.info("devices: %s; host memory %.1f GiB (%.1f GiB available)", devices or "cpu only",
             health.host_total_bytes / 2**30, health.host_available_bytes / 2**30,
             extra={"fields": {"devices": [d.name for d in health.devices], "host_total_bytes": health.host_total_bytes}})
    database = safe_database_url(c.resolved_database_url)
    log.info("database %s; data dir %s; checkpoints in %s", database, c.data_dir, c.resolved_checkpoint_dir,
             extra={"fields": {"database": database, "data_dir": str(c.data_dir),
                               "checkpoint_dir": str(c.resolved_checkpoint_dir)}})
    url = server_url(state)
    stack = http_stack()
    log.info("serving the Tinker API at %s (HTTP by %s, %s loop); dashboard at %s/dashboard, metrics at %s/metrics%s",
             url, stack["http"], stack["loop"], url, url, " (API key required)" if c.metrics_auth else "",
             extra={"fields": {"url": url, "dashboard": f"{url}/dashboard", "metrics": f"{url}/metrics", **stack}})
    _warn_of_http_fallbacks(stack)
