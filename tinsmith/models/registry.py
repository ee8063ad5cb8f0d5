"""Which ``architectures`` value in config.json maps to which model family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import torch

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig, VisionConfig, config_from_hf


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    attention_bias: bool
    qk_norm: bool
    moe: bool = False  # routed experts in (some of) the feed-forward layers
    # Image-text families: reads the vision part of config.json (None: a text-only family).
    vision: Callable[[dict[str, Any]], VisionConfig] | None = None
    # Where the text decoder's weights sit in the checkpoint ("model.layers.0..." by default).
    text_prefix: str = "model."
    # A family whose config.json or checkpoint layout the shared readers do not cover supplies its own.
    custom_config: Callable[[dict[str, Any]], ModelConfig] | None = None
    # (our tensor name, config, checkpoint names) -> (source names, combine) or None, tried first.
    tensor_sources: Callable[[str, ModelConfig, Container[str]],
                             tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None] | None = None

    def config(self, raw: dict[str, Any]) -> ModelConfig:
        """The ModelConfig of a parsed config.json (a multimodal one keeps its decoder in ``text_config``)."""
        if self.custom_config is not None:
            return self.custom_config(raw)
        text = raw
        if "text_config" in raw and "num_hidden_layers" not in raw:
            text = {**raw["text_config"], "architectures": raw.get("architectures")}
            if "tie_word_embeddings" in raw and "tie_word_embeddings" not in raw["text_config"]:
                text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        cfg = config_from_hf(text, self.name, attention_bias=self.attention_bias, qk_norm=self.qk_norm,
                             moe=self.moe)
        return dataclasses.replace(cfg, vision=None if self.vision is None else self.vision(raw),
                                   text_prefix=self.text_prefix)


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
    from tinsmith.models import gpt_oss, llama, qwen2, qwen3, qwen3_5, qwen3_moe, qwen3_vl  # noqa: F401
