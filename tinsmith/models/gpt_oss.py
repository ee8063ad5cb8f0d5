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
        norm_scale_in_fp32=True,
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        moe=MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=base.intermediate_size,
                      router_bias=True, softmax_after_topk=True, router_name="router", expert_bias=True,
                      activation="clamped_swiglu", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(raw.get("swiglu_limit", 7.0))),
    )


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def expert_weight_sources(name: str, cfg: ModelConfig, available: Container[str]
                          ) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
    """Our per-projection expert tensors from gpt-oss's fused ones (plain or MXFP4): the stored
    tensors to read, and how to build ours (experts x out x in) from them; None if not an expert."""
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


def to_hf_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weights under transformers' gpt-oss names and layout: each layer's expert gate and up
    interleaved back into ``gate_up_proj`` (experts x in x 2I), ``down_proj`` as experts x in x out."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[f"{m.group(2)}.{m.group(3)}"] = t
    for prefix, p in experts.items():
        gate, up = p["gate_proj.weight"], p["up_proj.weight"]  # (E, I, H)
        fused = gate.new_empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        fused[:, 0::2], fused[:, 1::2] = gate, up
        out[f"{prefix}.gate_up_proj"] = fused.transpose(1, 2).contiguous()
        bias = p["gate_proj.bias"].new_empty(gate.shape[0], 2 * gate.shape[1])
        bias[:, 0::2], bias[:, 1::2] = p["gate_proj.bias"], p["up_proj.bias"]
        out[f"{prefix}.gate_up_proj_bias"] = bias
        out[f"{prefix}.down_proj"] = p["down_proj.weight"].transpose(1, 2).contiguous()
        out[f"{prefix}.down_proj_bias"] = p["down_proj.bias"]
    return out


# ----------------------------------------------------------------------------- PEFT layout
# transformers' gpt-oss experts are parameters, not modules: peft adapts them with
# ``target_parameters`` (nested ``ParamWrapper``s: gate_up_proj inside, down_proj outside), one
# A/B pair per parameter whose rows stack the experts (A: experts*r x in, B: out x r*experts with
# columns ordered (rank, expert)). Our separate gate and up adapters become one of rank 2r whose
# B is block-diagonal, gate rows on even and up rows on odd outputs (the fused interleaving), or
# gate rows first and up rows after them (``interleaved=False``: Qwen3.5-MoE's fused experts).
PEFT_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_OURS = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$")
_PEFTS = re.compile(r"^(.*\.mlp\.experts)\.(base_layer\.)?lora_([AB])\.weight$")


def peft_expert_config(spec_rank: int, alpha: float) -> dict[str, Any]:
    """adapter_config.json entries for the experts: the parameters, and gate_up's doubled rank
    with a doubled alpha so its scale (alpha / rank) is the adapter's."""
    return {"target_parameters": PEFT_TARGET_PARAMETERS, "rank_pattern": {"gate_up_proj": 2 * spec_rank},
            "alpha_pattern": {"gate_up_proj": 2 * alpha}}


def to_peft_tensors(tensors: dict[str, torch.Tensor], interleaved: bool = True) -> dict[str, torch.Tensor]:
    """Our expert LoRA tensors (stacked per expert) under peft's gpt-oss names; others pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _OURS.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[f"{m.group(2)}.{m.group(3)}"] = t
    for prefix, p in experts.items():
        a_d, b_d = p["down_proj.A"], p["down_proj.B"]  # (E, r, I), (E, H, r)
        e, r = a_d.shape[0], a_d.shape[1]
        out[f"{prefix}.lora_A.weight"] = a_d.reshape(e * r, -1)
        out[f"{prefix}.lora_B.weight"] = b_d.permute(1, 2, 0).reshape(b_d.shape[1], r * e)
        a_g, a_u, b_g, b_u = p["gate_proj.A"], p["up_proj.A"], p["gate_proj.B"], p["up_proj.B"]
        out[f"{prefix}.base_layer.lora_A.weight"] = torch.cat((a_g, a_u), dim=1).reshape(e * 2 * r, -1)
        i = b_g.shape[1]
        b = b_g.new_zeros(e, 2 * i, 2 * r)
        gate_rows, up_rows = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, i), slice(i, None))
        b[:, gate_rows, :r], b[:, up_rows, r:] = b_g, b_u
        out[f"{prefix}.base_layer.lora_B.weight"] = b.permute(1, 2, 0).reshape(2 * i, 2 * r * e)
    return out


def from_peft_tensors(tensors: dict[str, torch.Tensor], rank: int, interleaved: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft_tensors` for an adapter of rank ``rank``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PEFTS.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[f"{'gate_up' if m.group(2) else 'down'}.{m.group(3)}"] = t
    for prefix, p in experts.items():
        if set(p) != {"gate_up.A", "gate_up.B", "down.A", "down.B"}:
            raise InvalidInputError(f"adapter experts {prefix!r}: need gate_up_proj and down_proj A/B, have {sorted(p)}")
        a_d, b_d = p["down.A"], p["down.B"]
        if a_d.shape[0] % rank:
            raise InvalidInputError(f"adapter tensor {prefix}.lora_A.weight: {a_d.shape[0]} rows are not experts x rank {rank}")
        e = a_d.shape[0] // rank
        out[f"{prefix}.down_proj.lora_A.weight"] = a_d.reshape(e, rank, -1)
        out[f"{prefix}.down_proj.lora_B.weight"] = b_d.reshape(b_d.shape[0], rank, e).permute(2, 0, 1)
        a = p["gate_up.A"].reshape(e, 2 * rank, -1)
        b = p["gate_up.B"].reshape(p["gate_up.B"].shape[0], 2 * rank, e).permute(2, 0, 1)  # (E, 2I, 2r)
        out[f"{prefix}.gate_proj.lora_A.weight"], out[f"{prefix}.up_proj.lora_A.weight"] = a[:, :rank], a[:, rank:]
        i = b.shape[1] // 2
        gate_rows, up_rows = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, i), slice(i, None))
        out[f"{prefix}.gate_proj.lora_B.weight"] = b[:, gate_rows, :rank]
        out[f"{prefix}.up_proj.lora_B.weight"] = b[:, up_rows, rank:]
    return {k: v.contiguous() for k, v in out.items()}


GPT_OSS = register(Family(name="gpt_oss", architectures=("GptOssForCausalLM",), attention_bias=True, qk_norm=False,
                          moe=True, custom_config=_config, tensor_sources=expert_weight_sources))
