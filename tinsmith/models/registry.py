"""Which ``architectures`` value in config.json maps to which model family."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import torch

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig, config_from_hf


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    attention_bias: bool
    qk_norm: bool
    moe: bool = False  # routed experts in (some of) the feed-forward layers
    # A family whose config.json or checkpoint layout the shared readers do not cover supplies its own.
    custom_config: Callable[[dict[str, Any]], ModelConfig] | None = None
    # (our tensor name, config, checkpoint names) -> (source names, combine) or None, tried first.
    tensor_sources: Callable[[str, ModelConfig, Container[str]],
                             tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None] | None = None

    def config(self, raw: dict[str, Any]) -> ModelConfig:
        if self.custom_config is not None:
            return self.custom_config(raw)
        return config_from_hf(raw, self.name, attention_bias=self.attention_bias, qk_norm=self.qk_norm, moe=self.moe)


_BY_ARCH: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        _BY_ARCH[arch] = family
    return family


def family_named(name: str) -> Family:
    """The registered family called ``name`` (a ModelConfig's ``family``)."""
    _load_families()
    return next(f for f in _BY_ARCH.values() if f.name == name)


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
    from tinsmith.models import gpt_oss, llama, qwen2, qwen3, qwen3_moe  # noqa: F401
