"""Qwen3-VL: the Qwen3 text decoder with a vision tower whose features replace image tokens.

The checkpoint keeps the decoder under ``model.language_model.*`` (read by tinsmith's own
Qwen3 code, with multimodal RoPE) and the vision encoder under ``model.visual.*``. The vision
encoder is transformers' own ``Qwen3VLVisionModel``: frozen (no adapters reach it), it turns an
image's patches into one embedding per merged patch, plus the DeepStack features that the
first decoder layers add to the image positions.
"""

from __future__ import annotations

import json
from typing import Any

from tinsmith.models.config import VisionConfig
from tinsmith.models.registry import Family, register


def vision_config(raw: dict[str, Any], tower: str = "qwen3_vl") -> VisionConfig:
    """The image side of an image-text config.json (Qwen3-VL's layout, which Qwen3.5's shares);
    ``tower``: which vision encoder class reads its ``vision_config``."""
    vision = raw["vision_config"]
    return VisionConfig(
        image_token_id=int(raw["image_token_id"]),
        vision_start_token_id=int(raw["vision_start_token_id"]),
        patch_size=int(vision.get("patch_size", 16)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        raw_json=json.dumps(vision, sort_keys=True),
        tower=tower,
    )


QWEN3_VL = register(Family(name="qwen3_vl", architectures=("Qwen3VLForConditionalGeneration",),
                           attention_bias=False, qk_norm=True, vision=vision_config,
                           text_prefix="model.language_model."))
