"""Which ``architectures`` value in config.json maps to which model family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig, config_from_hf


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    attention_bias: bool
    qk_norm: bool
    moe: bool = False  # routed experts in (some of) the feed-forward layers

    def config(self, raw: dict[str, Any]) -> ModelConfig:
        return config_from_hf(raw, self.name, attention_bias=self.attention_bias, qk_norm=self.qk_norm, moe=self.moe)


_BY_ARCH: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        _BY_ARCH[arch] = family
    return family


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(_BY_ARCH)


def family_for(raw: dict[str, Any]) -> Family:
    """The family of a parsed config.json, or a clear error naming its ``architectures``."""
    _load_families()
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    raise InvalidInputError(
        f"unsupported model architecture {archs!r} (config.json 'architectures'); "
        f"supported: {', '.join(sorted(_BY_ARCH))}"
    )


def _load_families() -> None:
    # Importing the family modules registers them; kept lazy to avoid import cycles.
    from tinsmith.models import llama, qwen2, qwen3, qwen3_moe  # noqa: F401
