"""Qwen3.5 (dense) and Qwen3.5-MoE: hybrid decoders of Gated DeltaNet and gated attention layers.

``layer_types`` in config.json (or ``full_attention_interval``, default 4: every fourth layer)
says which layers are full attention; the others are Gated DeltaNet
(:mod:`tinsmith.models.gated_deltanet`). Attention has per-head q/k RMSNorm, a sigmoid output
gate (q_proj doubles its width), and rotary on the first ``partial_rotary_factor`` of each head.
Every RMSNorm but DeltaNet's gated one scales by ``1 + weight``. The MoE variant routes every
layer (softmax, top-k, renormalised) and adds a shared expert weighted by a sigmoid gate.

Released checkpoints are image-text (``Qwen3_5ForConditionalGeneration``: the decoder under
``model.language_model.``, a vision tower under ``model.visual.``, multi-token-prediction
weights under ``mtp.``). Their vision tower (transformers' own ``Qwen3_5VisionModel``, frozen)
turns images into the features of their image tokens, as Qwen3-VL's does but without DeepStack,
and the full-attention layers turn by multimodal RoPE (``mrope_section`` of the rotary
frequencies, interleaved; text tokens have three equal positions, so for text it is plain
RoPE). The multi-token-prediction weights are left unread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import LinearAttnConfig, ModelConfig, config_from_hf
from tinsmith.models.qwen3_vl import vision_config
from tinsmith.models.registry import Family, register

LAYER_TYPES = {"linear_attention", "full_attention"}
# transformers' Qwen3.5 rotary turns its frequencies by these (temporal, height, width) sections
# when config.json names none.
DEFAULT_MROPE_SECTION = (11, 11, 10)


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    if "text_config" not in raw or "num_hidden_layers" in raw:
        return raw
    text = {**raw["text_config"], "architectures": raw.get("architectures")}
    if "tie_word_embeddings" in raw and "tie_word_embeddings" not in raw["text_config"]:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def _config(raw: dict[str, Any], family: str, moe: bool) -> ModelConfig:
    text = dict(_text_config(raw))
    text.setdefault("intermediate_size", text.get("moe_intermediate_size", 0))  # MoE configs have none
    base = config_from_hf(text, family, attention_bias=False, qk_norm=True, moe=moe)
    try:
        linear = LinearAttnConfig(
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            num_key_heads=int(text["linear_num_key_heads"]),
            num_value_heads=int(text["linear_num_value_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]),
            value_head_dim=int(text["linear_value_head_dim"]),
        )
    except KeyError as e:
        raise InvalidInputError(f"config.json of a Qwen3.5 model lacks {e.args[0]!r}") from e
    if linear.num_value_heads % linear.num_key_heads:
        raise InvalidInputError(f"config.json: linear_num_value_heads ({linear.num_value_heads}) must be a "
                                f"multiple of linear_num_key_heads ({linear.num_key_heads})")
    interval = int(text.get("full_attention_interval", 4))
    layer_types = tuple(text.get("layer_types") or ("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                                    for i in range(base.num_layers)))
    if set(layer_types) - LAYER_TYPES or len(layer_types) != base.num_layers:
        raise InvalidInputError(f"config.json layer_types {list(layer_types)!r}: need one of "
                                f"linear_attention/full_attention per layer ({base.num_layers})")
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    image_text = "vision_config" in raw and "image_token_id" in raw and "vision_start_token_id" in raw
    cfg = dataclasses.replace(
        base, layer_types=layer_types, linear_attn=linear, attn_output_gate=True, norm_offset=True,
        partial_rotary_factor=partial,
        rope=dataclasses.replace(base.rope, mrope_section=base.rope.mrope_section or DEFAULT_MROPE_SECTION),
        vision=vision_config(raw, tower=family) if image_text else None,
        text_prefix="model.language_model." if "text_config" in raw else "model.")
    if moe:
        assert cfg.moe is not None
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True,
                                                               shared_expert_intermediate_size=shared))
    return cfg


QWEN3_5 = register(Family(
    name="qwen3_5", architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    attention_bias=False, qk_norm=True, custom_config=lambda raw: _config(raw, "qwen3_5", moe=False)))
QWEN3_5_MOE = register(Family(
    name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    attention_bias=False, qk_norm=True, moe=True, custom_config=lambda raw: _config(raw, "qwen3_5_moe", moe=True)))
