"""Shared decoder building blocks: RMSNorm, rotary embeddings, attention, gated MLP.

Module and parameter names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``...) so
checkpoints load by name. Every projection is a :class:`LoraLinear`, so any of them can carry
tenant adapters; which ones do is decided per adapter (attn / mlp / unembed targets).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tinsmith.kernels import norm_grad
from tinsmith.kernels import rms_norm as rms_kernel
from tinsmith.kernels import swiglu
from tinsmith.models.config import ModelConfig, RopeConfig
from tinsmith.models.gated_deltanet import LINEAR_TARGETS, GatedDeltaNet
from tinsmith.models.lora import LoraLinear, PackedProjection, Segments, trained_together
from tinsmith.models.lora_bank import (PendingExpand, Unexpanded, adapters_changed, expands_taken_by, finished,
                                       shrinks_taken_by)
from tinsmith.models.moe import EXPERT_TARGETS, ExpertLinear, SparseMoeBlock

_WEIGHT_VERSIONS = itertools.count(1)  # one sequence for every model: a version is never handed out twice

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# How masked attention meets grouped-query heads: "auto" (K/V repeated per query head on CUDA,
# where SDPA's fused kernels take a mask or grouped heads but not both: flash no mask, memory-
# efficient no grouped heads, cuDNN off (slow first calls); left grouped elsewhere), or forced
# "repeat" / "grouped" (tests compare the two).
MASKED_GQA = "auto"
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, scale_in_fp32: bool = False, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # gpt-oss scales in fp32 and casts once (its transformers class); others cast, then scale.
        self.scale_in_fp32 = scale_in_fp32
        # Qwen3.5 stores the weight centred on zero: it scales by (1 + weight), in fp32.
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if self.scale_in_fp32 and x.dtype != torch.float32:
            return (self.weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)).to(x.dtype)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back, then scale (the order Hugging Face uses, so bf16 matches).

    ``weight`` broadcasts against ``x``'s trailing dimensions (one row per head is allowed).
    On a GPU the same arithmetic runs as one kernel: :mod:`tinsmith.kernels.rms_norm` outside
    autograd, :mod:`tinsmith.kernels.norm_grad` (a kernel each way) under it.
    """
    if rms_kernel.usable(x, weight):
        out = rms_kernel.rms_norm(x, weight, eps)
        if out is not None:
            return out
    elif norm_grad.usable(x, weight):
        out = norm_grad.norm_rotary(x, weight, eps)
        if out is not None:
            return out
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | Unexpanded,
                 norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, norm(h + delta))``: a residual add and the norm after it, in one kernel where
    :mod:`tinsmith.kernels.rms_norm` takes them (outside autograd on a GPU, a plain norm), else as
    the two steps (the same arithmetic). ``norm``: an :class:`RMSNorm`, or a module that is one
    outside autograd (its ``inference_norm``: a tensor-parallel model's norm before its sharded
    projections). ``delta`` may be an :class:`Unexpanded` projection output (a decode step's o or
    down projection over adapter banks): the kernel adds its deltas as it loads it where it can,
    else they are added first."""
    plain = norm if torch.is_grad_enabled() else getattr(norm, "inference_norm", norm)
    kernel = isinstance(plain, RMSNorm) and not (plain.offset or plain.scale_in_fp32)
    if isinstance(delta, Unexpanded):
        lora = delta.pending.kernel_args()
        if kernel and rms_kernel.add_usable(h, delta.y, plain.weight) and rms_kernel.add_lora_usable(
                h, lora[0], lora[1], lora[3]):
            both = rms_kernel.add_rms_norm(h, delta.y, plain.weight, plain.eps, lora)
            if both is not None:
                return both
        delta = delta.finished()  # the kernel cannot take the deltas here, or failed (it writes nothing of y)
    if kernel and rms_kernel.add_usable(h, delta, plain.weight):
        both = rms_kernel.add_rms_norm(h, delta, plain.weight, plain.eps)
        if both is not None:
            return both
    h = h + delta
    return h, norm(h)


def expands_to_norms(h: torch.Tensor) -> bool:
    """Whether a decode step's o and down projections may leave their banks' expands to the residual
    add and norm after them (:func:`add_rms_norm`): outside autograd, where its kernel runs, unless
    :data:`tinsmith.models.lora_bank.EXPANDS_TAKEN` says otherwise."""
    return expands_taken_by("norms") and rms_kernel.allowed(h)


def norm_and_rotary(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    signed_sin: torch.Tensor, second: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``apply_rotary(rms_norm(x, weight, eps), cos, signed_sin)``: the q/k heads' norm then their
    rotary, in one kernel where :mod:`tinsmith.kernels.rms_norm` takes both (outside autograd on
    a GPU), else as the two steps. ``second``: ``(s, weight2)``, the heads from ``s`` on are
    normalised with ``weight2`` (the k heads after the q heads of a packed output)."""
    if rms_kernel.usable(x, weight) and rms_kernel.rotary_usable(x, cos, signed_sin):
        out = rms_kernel.rms_norm(x, weight, eps, (cos, signed_sin), second)
        if out is not None:
            return out
    if second is None and norm_grad.usable(x, weight, (cos, signed_sin)):
        out = norm_grad.norm_rotary(x, weight, eps, (cos, signed_sin))
        if out is not None:
            return out
    if second is not None:
        split, weight2 = second
        weight = torch.cat((weight.expand(split, -1), weight2.expand(x.shape[-2] - split, -1)))
    return apply_rotary(rms_norm(x, weight, eps), cos, signed_sin)


def turn_and_store(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, split: int, v: torch.Tensor,
                   target: tuple[torch.Tensor, ...],
                   norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
                   lora: tuple[PendingExpand, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A decode step's packed q/k heads ``x`` turned (after their norm where ``norm``: ``(weight,
    eps, weight2)``, the q heads' weight, its eps, the k heads' from ``split`` on:
    :func:`norm_and_rotary`; else :func:`apply_rotary` alone, a model without q/k norms), the
    step's keys (the heads from ``split`` on, as they come out) and values ``v`` also written into
    the K/V cache at ``target`` (``(K, V, page, at)``: the pools, and each row's page and offset,
    where the step's attention would write them), all in one kernel: a launch less per attention
    layer and step. None where that kernel does not take it here; the caller then turns the heads,
    and the attention stores, as before. ``lora``: ``(pending, y)``, the q/k/v bank's expand not yet
    added into the packed output ``y`` that ``x`` and ``v`` view: the kernel adds it as it loads
    them (a launch less again) where it can; otherwise, and where the kernel fails, it is added into
    ``y`` here, so the caller's paths find it there whatever this returns."""
    K, V, page, at = target
    store = (K, V, v, page, at)
    usable = rms_kernel.store_usable(x, v, K, V, split) and rms_kernel.rotary_usable(x, cos, signed_sin)
    if norm is None:
        usable = usable and rms_kernel.turn_usable(x, cos, signed_sin)
    else:
        usable = usable and rms_kernel.usable(x, norm[0])
    args = None
    if lora is not None:
        pending, y = lora
        args = pending.kernel_args()
        if not (usable and rms_kernel.lora_usable(x, v, *args[:2], args[3])):
            pending.apply_(y)
            args = None
    if not usable:
        return None
    if norm is None:
        turned = rms_kernel.turn(x, cos, signed_sin, split, store=store, lora=args)
    else:
        weight, eps, weight2 = norm
        turned = rms_kernel.rms_norm(x, weight, eps, (cos, signed_sin), (split, weight2), store=store, lora=args)
    if turned is None and args is not None:  # the kernel failed here (it writes nothing of y)
        pending.apply_(y)
    return turned


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, including the Llama 3 or YaRN long-context rescaling when configured."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "yarn":
        return _yarn_inv_freq(head_dim, rope)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def _yarn_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolated frequencies below the ``beta_slow``..``beta_fast`` rotation band,
    extrapolated above it, a linear ramp between (transformers' ``_compute_yarn_parameters``)."""
    base, dim = rope.theta, head_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_scaling(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's ``0.1 ln(factor) + 1`` unless configured; 1 otherwise."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0


# The most positions a model's rotary tables cover (:meth:`Rotary.forward`'s ``tabled``): two
# tables of this many rows of the rotary's width, in the model's dtype (67 MB for a 131,072-token
# context and 128-wide heads in bf16); a model of a longer context computes its turns every step.
TABLE_MAX_POSITIONS = 1 << 17


class Rotary(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self.mrope_section = rope.mrope_section
        self.scaling = rope_attention_scaling(rope)
        # Tables only where every position a caller may ask is below them: the model's context.
        self.max_positions = max_positions if max_positions is not None and max_positions <= TABLE_MAX_POSITIONS else None
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                tabled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of shape ``(b, L, 1, head_dim)`` (computed in fp32).

        ``tabled``: the caller's ``positions`` are all below the model's context (the sampler's
        requests fit it), so each row's turns may be read from tables of every position, made
        once (:meth:`tables`): two gathers where computing them takes nine kernels (the cast,
        the products, cos, sin, the negation, two concatenations and two casts), at every decode
        step. The values are the same bits: the tables are computed by the same operations, each
        element on its own. Plain RoPE only (2-D ``positions``, a model of a known context).

        ``positions`` is ``(b, L)``, or ``(3, b, L)`` temporal/height/width positions for
        multimodal RoPE (Qwen3-VL): frequency ``i`` turns with the height position when
        ``i % 3 == 1`` (for the first ``3 * mrope_section[1]``), with the width position when
        ``i % 3 == 2`` (first ``3 * mrope_section[2]``), else with the temporal one. Text tokens
        have three equal positions, so for them this is plain RoPE.

        ``signed_sin`` is ``[-sin, sin]`` over the two halves, so :func:`apply_rotary` needs one
        ``roll`` instead of slicing, negating and concatenating (the result is bit-identical).
        The singleton dimension broadcasts over heads in the ``(b, L, heads, d)`` layout.
        """
        if tabled and positions.dim() == 2 and self.max_positions is not None:
            cos, signed_sin = self.tables(positions.device, dtype)
            return F.embedding(positions, cos)[..., None, :], F.embedding(positions, signed_sin)[..., None, :]
        freqs = positions.float()[..., None] * self.inv_freq.float()
        if positions.dim() == 3:
            if len(self.mrope_section) != 3:
                raise ValueError("3-D positions need a model with multimodal RoPE (mrope_section)")
            mixed = freqs[0].clone()
            for axis in (1, 2):
                pick = slice(axis, 3 * self.mrope_section[axis], 3)
                mixed[..., pick] = freqs[axis][..., pick]
            freqs = mixed
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return torch.cat((cos, cos), -1)[..., None, :].to(dtype), torch.cat((-sin, sin), -1)[..., None, :].to(dtype)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of every position below ``max_positions``, ``(positions, head_dim)``
        each, made on first use and kept: a decode step's CUDA graph reads them at a fixed
        address (its first, eager run makes them, outside the capture)."""
        key = (device, dtype)
        if key not in self._tables:
            assert self.max_positions is not None, "a rotary without max_positions keeps no tables"
            with torch.no_grad():
                cos, signed_sin = self.forward(torch.arange(self.max_positions, device=device)[None], dtype)
            self._tables[key] = (cos[0, :, 0].contiguous(), signed_sin[0, :, 0].contiguous())
        return self._tables[key]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (b, L, heads, d): ``x cos + rotate_half(x) sin``.

    ``rotate_half(x) * sin`` equals ``roll(x, d/2) * [-sin, sin]`` exactly. When cos/sin are
    narrower than ``x`` (partial rotary, Qwen3.5), only the leading dimensions turn. Under
    autograd on a GPU a full-width rotary is one kernel each way (:mod:`tinsmith.kernels.norm_grad`),
    outside it one kernel (:func:`tinsmith.kernels.rms_norm.turn`) where torch takes four.
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :r], cos, signed_sin), x[..., r:]), dim=-1)
    if norm_grad.usable(x, None, (cos, signed_sin)):
        out = norm_grad.norm_rotary(x, None, 0.0, (cos, signed_sin))
        if out is not None:
            return out
    if rms_kernel.turn_usable(x, cos, signed_sin):  # outside autograd on a GPU: one kernel, these roundings
        out = rms_kernel.turn(x, cos, signed_sin)
        if out is not None:
            return out
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class AttentionBackend(Protocol):
    """How a layer's queries meet keys/values: plain causal for training, cached for sampling.

    ``sinks`` (one logit per query head, added to every softmax denominator) and ``window``
    (a sliding-attention layer's span, the query's own position included) come from the layer.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor: ...


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal SDPA over right-padded rows (padding sits after real tokens, so no mask is needed).

    Grouped-query heads are handled by SDPA itself, so K/V are never copied per query head.
    """
    if sinks is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    L = q.shape[2]
    i = torch.arange(L, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return masked_attention(q, k, v, allowed[None], sinks)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention where ``allowed`` (b or 1, Lq, Lk; bool) says which keys each query sees.

    q: (b, Hq, Lq, d); k, v: (b, Hk, Lk, d). ``sinks`` (Hq,) add one logit per head to every
    softmax denominator (gpt-oss). Single-query steps (decode) compute it eagerly; longer
    queries go through SDPA with the sink as one extra key (see :func:`_sink_as_key`), so no
    (Lq x Lk) float score matrix per head is kept for backward by fused kernels.
    """
    if sinks is None:
        return _masked_sdpa(q, k, v, allowed[:, None])
    if q.shape[2] == 1:
        return eager_sink_attention(q, k, v, allowed, sinks)
    return _sink_as_key(q, k, v, allowed, sinks)


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
    """SDPA with a boolean ``mask``. With grouped-query heads on CUDA, K/V are repeated per query
    head (:data:`MASKED_GQA`): otherwise no fused kernel takes the call and SDPA's math fallback
    keeps a (heads x Lq x Lk) probability matrix per layer (gigabytes at 8k tokens) for backward.
    The copies cost ``Hq / Hk`` times the K/V, a small share of that."""
    hq, hk = q.shape[1], k.shape[1]
    repeat = hk != hq and (MASKED_GQA == "repeat" or (MASKED_GQA == "auto" and q.is_cuda))
    if repeat:
        k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hk != hq and not repeat)


def eager_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                         sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss ``eager_attention_forward``: softmax over the scores plus one sink
    logit per head (maximum subtracted over both), the sink's share dropped."""
    b, hq, lq, d = q.shape
    hk = k.shape[1]
    rep = hq // hk
    qg = q.reshape(b, hk, rep, lq, d)
    scores = (qg @ k[:, :, None].transpose(-1, -2)) * (d ** -0.5)  # (b, hk, rep, lq, lk)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, hk, rep, 1, 1).expand(b, hk, rep, lq, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
    return (probs @ v[:, :, None]).reshape(b, hq, lq, d)


_SINK_PAD = 8  # extra head dimensions for the sink key (a multiple of 8 keeps fused kernels usable)


def _sink_as_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
    """Sink attention as plain SDPA: one more key, visible to every query, whose logit is the sink.

    Queries get ``_SINK_PAD`` extra dimensions holding ``sink_h / scale`` then zeros; real keys
    get zeros there, so their logits are unchanged; the extra key is zero but for a 1 in the
    first extra dimension, so its logit is ``scale * sink_h / scale = sink_h`` for head ``h``,
    and its value is zero, so it only adds ``exp(sink_h)`` to the denominator. The head
    dimension's own scale is passed explicitly.
    """
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    scale = d ** -0.5
    q_sink = (sinks.to(q.dtype) / scale).reshape(1, hq, 1, 1).expand(b, hq, lq, 1)
    q_ext = torch.cat((q, q_sink, q.new_zeros(b, hq, lq, _SINK_PAD - 1)), dim=-1)
    k_ext = torch.cat((k, k.new_zeros(b, hk, lk, _SINK_PAD)), dim=-1)
    sink_key = k.new_zeros(b, hk, 1, d + _SINK_PAD)
    sink_key[..., d] = 1.0
    k_ext = torch.cat((k_ext, sink_key), dim=2)
    v_ext = torch.cat((v, v.new_zeros(b, hk, 1, v.shape[-1])), dim=2)
    mask = torch.cat((allowed, allowed.new_ones(*allowed.shape[:-1], 1)), dim=-1)
    return _masked_sdpa(q_ext, k_ext, v_ext, mask[:, None], scale)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        # Qwen3.5: q_proj also yields a per-head output gate (each head's query, then its gate).
        self.output_gate = cfg.attn_output_gate
        self.q_proj = LoraLinear(h, cfg.num_heads * cfg.head_dim * (2 if self.output_gate else 1), bias)
        self.k_proj = LoraLinear(h, cfg.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = LoraLinear(h, cfg.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = LoraLinear(cfg.num_heads * cfg.head_dim, h, cfg.attention_out_bias)
        # gpt-oss: a frozen per-head sink logit, and a sliding window on some layers.
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None
        self.sliding_window = cfg.window_of(layer_idx)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None

        # Set by ``pack_weights``: q/k/v weights as views of one buffer, for one GEMM at inference.
        self.packed_qkv: PackedProjection | None = None

    def forward(self, x, cos, sin, segments: Segments | None, attend: AttentionBackend,
                leave_expand: bool = False) -> torch.Tensor | Unexpanded:
        """The attention block's output; with ``leave_expand`` (inference, the caller adds it to the
        residual by :func:`add_rms_norm`) possibly :class:`Unexpanded` (its o projection's bank
        expand left to that kernel)."""
        b, L, _ = x.shape
        H, Hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        packed = self.packed_qkv
        stored = False  # whether this step's keys and values are in the cache already
        if packed is not None and not torch.is_grad_enabled() and packed.intact():
            # Inference: one GEMM for q, k and v; norm and rotary over q and k heads together.
            # A decode step's attention may take its keys and values written by the kernel that
            # turns them, which then also adds the adapters' deltas (the bank's expand left to it).
            targets = getattr(attend, "store_target", None) if L == 1 else None  # None: no kernel can
            target = None if targets is None else targets(self.layer_idx)
            y, pending = packed.project_leaving_expand(x.reshape(b * L, -1), segments,
                                                       leave=target is not None and expands_taken_by("heads"))
            qk = y[:, : (H + Hk) * d].view(b, L, H + Hk, d)
            v = y[:, (H + Hk) * d :].view(b, L, Hk, d)
            norm = None if self.q_norm is None else (self.q_norm.weight, self.q_norm.eps, self.k_norm.weight)
            lora = None if pending is None else (pending, y)
            turned = None if target is None else turn_and_store(qk, cos, sin, H, v, target, norm, lora)
            stored = turned is not None
            if stored:
                qk = turned
            elif norm is not None:
                qk = norm_and_rotary(qk, norm[0], norm[1], cos, sin, (H, norm[2]))
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            gate = None
            qkv = trained_together((self.q_proj, self.k_proj, self.v_proj), x, segments, packed)
            q_out, k_out, v_out = qkv or (self.q_proj(x, segments), self.k_proj(x, segments), self.v_proj(x, segments))
            if self.output_gate:
                q, gate = q_out.view(b, L, H, 2 * d).chunk(2, dim=-1)
                gate = gate.reshape(b, L, H * d)
            else:
                q = q_out.view(b, L, H, d)
            k = k_out.view(b, L, Hk, d)
            v = v_out.view(b, L, Hk, d)
            q, k = _normed_and_turned(self.q_norm, q, cos, sin), _normed_and_turned(self.k_norm, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        told = {"stored": True} if stored else {}  # only a decode step's attention offers to be told
        if self.sinks is None and self.sliding_window is None:
            out = attend(self.layer_idx, q, k, v, **told)
        else:
            out = attend(self.layer_idx, q, k, v, sinks=self.sinks, window=self.sliding_window, **told)
        out = out.transpose(1, 2).reshape(b, L, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj.forward_leaving_expand(out, segments, leave_expand)


def _normed_and_turned(norm: RMSNorm | None, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary(norm(x), cos, sin)`` (no norm: the rotary alone): a plain norm and the rotary
    after it go through :func:`norm_and_rotary` (one kernel each way under autograd on a GPU)."""
    if norm is None:
        return apply_rotary(x, cos, sin)
    if norm.offset or norm.scale_in_fp32 or cos.shape[-1] != x.shape[-1]:
        return apply_rotary(norm(x), cos, sin)
    return norm_and_rotary(x, norm.weight, norm.eps, cos, sin)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = LoraLinear(h, i)
        self.up_proj = LoraLinear(h, i)
        self.down_proj = LoraLinear(i, h)
        self.packed_gate_up: PackedProjection | None = None  # set by ``pack_weights``

    def forward(self, x: torch.Tensor, segments: Segments | None,
                leave_expand: bool = False) -> torch.Tensor | Unexpanded:
        """The MLP's output; with ``leave_expand`` (inference, the caller adds it to the residual by
        :func:`add_rms_norm`) possibly :class:`Unexpanded` (the down projection's bank expand left to
        that kernel)."""
        packed = self.packed_gate_up
        if packed is not None and not torch.is_grad_enabled() and packed.intact():
            i = self.gate_proj.out_features
            x2 = x.reshape(-1, x.shape[-1])
            # Where the kernel runs, it also adds the adapters' deltas (the bank's expand left to it).
            y, pending = packed.project_leaving_expand(x2, segments,
                                                       leave=swiglu.allowed(x2) and expands_taken_by("silu"))
            lora = None if pending is None else pending.kernel_args()
            if lora is not None and not swiglu.lora_usable(y, *lora[:2]):
                pending.apply_(y)
                lora = None
            # ... and the down projection's shrink of its output, where it can.
            down = self.down_proj.fusable_bank(segments) if shrinks_taken_by("silu") and swiglu.usable(y) else None
            if down is not None and swiglu.shrink_usable(y.shape[0], down.A, i):
                both = swiglu.silu_mul_shrinking(y, lora, down.A, segments.idx)
                if both is not None:
                    return self.down_proj.forward_from_shrunk(both[0].view(*x.shape[:-1], i), both[1], down, segments,
                                                              leave_expand)
            h = swiglu.silu_mul(y, lora) if swiglu.usable(y) else None
            if h is None:  # the torch path, or the kernel failed here (it writes nothing of y)
                if lora is not None:
                    pending.apply_(y)
                h = F.silu(y[:, :i]).mul_(y[:, i:])
            h = h.view(*x.shape[:-1], i)
        else:
            both = trained_together((self.gate_proj, self.up_proj), x, segments, packed, side_by_side=True)
            if isinstance(both, torch.Tensor):  # several tenants: gate and up side by side
                h = swiglu.silu_mul_packed_grad(both) if swiglu.packed_grad_usable(both) else None
                if h is None:  # the torch path, or the kernels failed here
                    gate, up = both.split(self.gate_proj.out_features, dim=-1)  # backward: one cat
                    h = F.silu(gate) * up
            else:
                gate, up = both or (self.gate_proj(x, segments), self.up_proj(x, segments))
                h = swiglu.silu_mul_grad(gate, up) if swiglu.grad_usable(gate, up) else None
                if h is None:  # the torch path, or the kernels failed here
                    h = F.silu(gate) * up
        return self.down_proj.forward_leaving_expand(h, segments, leave_expand)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus one dense shared expert weighted by ``sigmoid(shared_expert_gate(x))``
    (Qwen3.5-MoE). The shared expert's projections are MLP LoRA targets; its gate is frozen."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        assert cfg.moe is not None
        self.shared_expert = MLP(cfg, cfg.moe.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        routed = super().forward(x, segments)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, segments)


def _feed_forward(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if not cfg.is_moe_layer(layer_idx):
        return MLP(cfg)
    assert cfg.moe is not None
    return SharedExpertMoeBlock(cfg) if cfg.moe.shared_expert_intermediate_size else SparseMoeBlock(cfg)


class DecoderLayer(nn.Module):
    """Attention (``self_attn``) or, on a hybrid model's linear layers, Gated DeltaNet
    (``linear_attn``), then the feed-forward block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        if cfg.is_linear_layer(layer_idx):
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        self.mlp: nn.Module = _feed_forward(cfg, layer_idx)
        norm = dict(scale_in_fp32=cfg.norm_scale_in_fp32, offset=cfg.norm_offset)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)

    def forward(self, h, cos, sin, segments: Segments | None, attend: AttentionBackend,
                pending: torch.Tensor | None = None, defer: bool = False):
        """The residual stream ``h`` after this layer.

        Inference passes the residual adds on to the norms after them (:func:`add_rms_norm`, one
        kernel for both on a GPU): ``pending`` is the previous layer's output not yet added to
        ``h``, and with ``defer`` the layer returns ``(h, its MLP's output)`` instead of their
        sum, for the next layer's norm (or the final one) to add.
        """
        if pending is None:
            x = self.input_layernorm(h)
        else:
            h, x = add_rms_norm(h, pending, self.input_layernorm)
        # A decode step's o and down projections may leave their adapters' expands to those norms:
        # the MLP's output then stays Unexpanded for the next layer's norm, with ``defer``.
        leave = expands_to_norms(h)
        if hasattr(self, "linear_attn"):
            mixed = self.linear_attn(x, segments, attend)
        else:
            mixed = self.self_attn(x, cos, sin, segments, attend, leave_expand=leave)
        h, x = add_rms_norm(h, mixed, self.post_attention_layernorm)
        out = self.mlp(x, segments, leave_expand=leave and defer) if isinstance(self.mlp, MLP) else self.mlp(
            x, segments)
        return (h, out) if defer else h + out


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_scale_in_fp32, cfg.norm_offset)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope, cfg.max_position_embeddings)


@dataclass
class VisualFeatures:
    """What a vision tower made of a batch's images, placed on the token grid.

    ``mask`` (b, L) marks the image positions; ``embeds`` (n, hidden) are their input
    embeddings in mask order (row-major), ``deepstack[i]`` (n, hidden) is added to them after
    decoder layer ``i``.
    """

    mask: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    def embed(self, h: torch.Tensor) -> torch.Tensor:
        return h.masked_scatter(self.mask[..., None], self.embeds.to(h.dtype))

    def add_deepstack(self, h: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if layer_idx >= len(self.deepstack):
            return h
        added = h[self.mask] + self.deepstack[layer_idx].to(h.dtype)
        return h.masked_scatter(self.mask[..., None], added)


class CausalLM(nn.Module):
    """A decoder-only LM. ``hidden_states`` runs the trunk; ``lm_head`` maps to logits."""

    # Whether a prompt's K/V at positions < p depend on its tokens < p alone, so a sampler may
    # keep them across requests (prefix caching). Models with per-row recurrent state set False.
    supports_prefix_reuse: bool = True

    # Whether training may pack several sequences into one row with per-document attention
    # (:mod:`tinsmith.models.document_attention`; hybrid models' Gated DeltaNet layers run their
    # recurrence per document). Every model may; a datum with images (whose multimodal positions
    # and image features are laid out per padded row) runs padded all the same
    # (``SequenceRef.padded``, :mod:`tinsmith.worker.batching`).
    supports_packing: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # adapter slot (None: the model's own weights) -> version, changed whenever those weights
        # change (see :meth:`weights_changed`); what a prefix cache keys its K/V by.
        self.weight_versions: dict[int | None, int] = {}
        self.model = Backbone(cfg)
        self.lm_head = LoraLinear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False  # every layer recomputes its activations in backward
        self.recomputed_layers: frozenset[int] = frozenset()  # ... or these (selective recomputation)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: Segments | None = None,
        attend: AttentionBackend = causal_attention,
        visual: VisualFeatures | None = None,
        within_context: bool = False,
    ) -> torch.Tensor:
        """tokens: (b, L); positions: (b, L), or (3, b, L) with multimodal RoPE. ``segments``
        index the flattened b*L rows. ``visual`` replaces the embeddings of image positions and
        adds its DeepStack features after the first layers. ``within_context``: every position
        is below the model's context, so the rotary turns come from its tables (a decode step's
        rows, which the sampler holds to the context: :meth:`Rotary.forward`). Returns (b, L, hidden)."""
        h = self.model.embed_tokens(tokens)
        if visual is not None:
            h = visual.embed(h)
        cos, sin = self.model.rotary(positions, h.dtype, tabled=within_context)
        if not torch.is_grad_enabled():  # each layer's last add joins the next norm (see DecoderLayer)
            pending = None
            for i, layer in enumerate(self.model.layers):
                h, pending = layer(h, cos, sin, segments, attend, pending, True)
                if visual is not None and i < len(visual.deepstack):
                    h, pending = visual.add_deepstack(h + finished(pending), i), None
            return self.model.norm(h) if pending is None else add_rms_norm(h, pending, self.model.norm)[1]
        recompute = self.gradient_checkpointing or bool(self.recomputed_layers)
        for i, layer in enumerate(self.model.layers):
            if recompute and (self.gradient_checkpointing or i in self.recomputed_layers):
                h = checkpoint(layer, h, cos, sin, segments, attend, use_reentrant=False)
            else:
                h = layer(h, cos, sin, segments, attend)
            if visual is not None:
                h = visual.add_deepstack(h, i)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor, segments: Segments | None = None, fp32: bool = True) -> torch.Tensor:
        """The unembedding's output, widened to fp32 unless ``fp32`` is False: a decode step's
        token choice reads the weights' dtype as it is (its kernel widens each block in registers,
        its torch path widens the whole first, to the same values), so the step skips writing and
        reading again a full-vocabulary fp32 copy (64 rows of Qwen3's vocabulary: 39 MB)."""
        out = self.lm_head(hidden, segments)
        return out.float() if fp32 else out

    def weights_changed(self, slot: int | None) -> None:
        """Record that adapter ``slot``'s weights (None: the model's own) changed: an optimizer
        step, a load, an adapter attached, installed or removed. Whatever was computed with the
        old weights (cached prompt K/V, an adapter bank's copy) must not be used again. The one
        call that code writing weights in place makes."""
        self.weight_versions[slot] = next(_WEIGHT_VERSIONS)
        if slot is not None:
            adapters_changed()

    def weights_version(self, slot: int | None) -> int:
        """The current version of adapter ``slot``'s weights (None: the model's own); 0 until first changed."""
        return self.weight_versions.get(slot, 0)

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[tuple[str, LoraLinear | ExpertLinear]]:
        """The (name, layer) pairs an adapter with these switches attaches to, in a fixed order.

        In a mixture-of-experts layer the MLP targets are the experts' stacked projections
        (``mlp.experts.gate_proj``...: one A/B per expert); the router is never a target.
        """
        out: list[tuple[str, LoraLinear | ExpertLinear]] = []
        for i, layer in enumerate(self.model.layers):
            if attn and hasattr(layer, "linear_attn"):
                out += [(f"model.layers.{i}.linear_attn.{n}", getattr(layer.linear_attn, n)) for n in LINEAR_TARGETS]
            elif attn:
                out += [(f"model.layers.{i}.self_attn.{n}", getattr(layer.self_attn, n)) for n in ATTN_TARGETS]
            if mlp and isinstance(layer.mlp, SparseMoeBlock):
                out += [(f"model.layers.{i}.mlp.experts.{n}", getattr(layer.mlp.experts, n)) for n in EXPERT_TARGETS]
                if isinstance(layer.mlp, SharedExpertMoeBlock):
                    out += [(f"model.layers.{i}.mlp.shared_expert.{n}", getattr(layer.mlp.shared_expert, n))
                            for n in MLP_TARGETS]
            elif mlp:
                out += [(f"model.layers.{i}.mlp.{n}", getattr(layer.mlp, n)) for n in MLP_TARGETS]
        if unembed:
            out.append(("lm_head", self.lm_head))
        return out
