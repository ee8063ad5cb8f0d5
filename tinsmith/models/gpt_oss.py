"""gpt-oss: attention sinks, sliding-window attention on alternate layers, YaRN rotary, biased
q/k/v/o, and routed experts with biases and a clamped SwiGLU.

Checked against transformers' ``GptOssForCausalLM``. The experts' fused ``gate_up_proj``
(experts x hidden x 2I, gate and up in alternate columns) is split into our per-expert
``gate_proj`` / ``up_proj`` (each a LoRA target, as in Qwen3-MoE); released checkpoints keep the
expert weights in MXFP4 (``*_blocks`` + ``*_scales``), dequantised here on load (bf16 on GPUs).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Container
from typing import Any

import torch

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig, MoeConfig, config_from_hf
from tinsmith.models.registry import Family, register

# MXFP4 (OCP microscaling FP4, e2m1): the 16 values a nibble encodes; each block of 32 values
# shares one power-of-two scale stored as a biased exponent (value = fp4 * 2^(scale - 127)).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks`` (..., rows, groups, 16 bytes) and ``scales`` (..., rows, groups) to
    (..., rows, groups * 32) values; the low nibble of each byte is the earlier value."""
    if blocks.shape[:-1] != scales.shape:
        raise InvalidInputError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)  # (..., groups, 32)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].to(dtype))
    return values.flatten(-2)


def _config(raw: dict[str, Any]) -> ModelConfig:
    base = config_from_hf(raw, "gpt_oss", attention_bias=True, qk_norm=False)
    try:
        experts, top_k = int(raw["num_local_experts"]), int(raw["num_experts_per_tok"])
    except KeyError as e:
        raise InvalidInputError(f"config.json of a gpt-oss model lacks {e.args[0]!r}") from e
    if not 0 < top_k <= experts:
        raise InvalidInputError(f"config.json: num_experts_per_tok ({top_k}) must be in 1..num_local_experts ({experts})")
    layer_types = tuple(raw.get("layer_types") or
                        ("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(base.num_layers)))
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != base.num_layers:
        raise InvalidInputError(f"config.json layer_types {list(layer_types)!r}: need one of "
                                f"sliding_attention/full_attention per layer ({base.num_layers})")
    window = raw.get("sliding_window")
    return dataclasses.replace(
        base,
        attention_out_bias=base.attention_bias,
        attention_sinks=True,
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        moe=MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=base.intermediate_size,
                      router_bias=True, softmax_after_topk=True, router_name="router", expert_bias=True,
                      activation="clamped_swiglu", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(raw.get("swiglu_limit", 7.0))),
    )


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def _tensor_sources(name: str, cfg: ModelConfig, available: Container[str]
                    ) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
    """Our per-projection expert tensors from gpt-oss's fused ones (plain or MXFP4)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, proj, kind = m.groups()
    fused = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    # gate and up alternate along the fused output dimension (transformers' ``gate_up[..., ::2]``).
    pick = (lambda t: t) if proj == "down_proj" else (lambda t: t[:, 0::2] if proj == "gate_proj" else t[:, 1::2])
    if kind == "bias":
        return ([f"{fused}_bias"], lambda ts: pick(ts[0]).contiguous()) if f"{fused}_bias" in available else None
    if fused in available:  # unquantised: experts x in x out
        return [fused], lambda ts: pick(ts[0].transpose(1, 2)).contiguous()
    if f"{fused}_blocks" in available and f"{fused}_scales" in available:  # MXFP4: experts x out x in
        return [f"{fused}_blocks", f"{fused}_scales"], lambda ts: pick(dequantize_mxfp4(ts[0], ts[1])).contiguous()
    return None


GPT_OSS = register(Family(name="gpt_oss", architectures=("GptOssForCausalLM",), attention_bias=True, qk_norm=False,
                          moe=True, custom_config=_config, tensor_sources=_tensor_sources))
