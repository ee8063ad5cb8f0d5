"""``tinker://{run_id}/{kind}/{name}`` paths, and where each checkpoint lives on disk."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tinsmith.errors import InvalidInputError

KINDS = ("weights", "sampler_weights", "external_weights")

# A checkpoint name is a directory name, and a save also writes ``.NAME.XXXXXXXX`` (the copy being
# written) and ``.NAME.old-PID`` (the copy being replaced) beside it; 200 characters keep every
# one of them within the file system's 255-byte limit on a name.
MAX_NAME_LENGTH = 200
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_LENGTH - 1}}}")


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600


def expiry_from_ttl(ttl_seconds: int | None) -> datetime | None:
    """When a checkpoint with this TTL expires (None: never); the range is the hosted service's."""
    if ttl_seconds is None:
        return None
    if not (MIN_TTL_S <= ttl_seconds <= MAX_TTL_S):
        raise InvalidInputError(
            f"ttl_seconds={ttl_seconds} must be between {MIN_TTL_S} and {MAX_TTL_S} (or null for no expiry)"
        )
    return datetime.now(timezone.utc) + timedelta(seconds=ttl_seconds)


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint name, checked whole before anything is written (a trailing newline included)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        shown = f"{name[:40]!r}... ({len(name)} characters)" if isinstance(name, str) and len(name) > 60 else repr(name)
        raise InvalidInputError(
            f"{field} {shown} is not a valid checkpoint name (1-{MAX_NAME_LENGTH} characters of letters, "
            "digits, '.', '_', '-', starting with a letter or digit; no '/' and no '..')"
        )
    return name


def parse_tinker_path(path: str, field: str = "model_path") -> TinkerPath:
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise InvalidInputError(f"{field} {path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or not all(parts):
        raise InvalidInputError(f"{field} {path!r} must look like tinker://RUN_ID/KIND/NAME")
    run_id, kind, name = parts
    if kind not in KINDS:
        raise InvalidInputError(f"{field} {path!r}: kind {kind!r} must be one of {', '.join(KINDS)}")
    check_name(name, field)
    return TinkerPath(run_id, kind, name)


def checkpoint_directory(root: Path, tp: TinkerPath) -> Path:
    """On-disk home of a checkpoint (run ids contain ':', which is fine in file names)."""
    safe_run = tp.run_id.replace("/", "_")
    return Path(root) / safe_run / tp.kind / tp.name
