"""``tinker://{run_id}/{kind}/{name}`` paths, and where each checkpoint lives on disk."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tinsmith.errors import InvalidInputError

KINDS = ("weights", "sampler_weights", "external_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


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


def check_name(name: str, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidInputError(
            f"{field} {name!r} is not a valid checkpoint name (1-255 characters of letters, digits, '.', '_', '-'; "
            "no '/')"
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
