"""Shared decoder building blocks: RMSNorm, rotary embeddings, attention, gated MLP.

Module and parameter names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``...) so
checkpoints load by name. Every projection is a :class:`LoraLinear`, so any of them can carry
tenant adapters; which ones do is decided per adapter (attn / mlp / unembed targets).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tinsmith.models.config import ModelConfig, RopeConfig
from tinsmith.models.lora import LoraLinear, Segments

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, including the Llama 3 long-context rescaling when configured."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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


class Rotary(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``positions.shape + (head_dim,)`` (computed in fp32)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, L, d); cos/sin: (b, L, d)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class AttentionBackend(Protocol):
    """How a layer's queries meet keys/values: plain causal for training, cached for sampling."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over right-padded rows (padding sits after real tokens, so no mask is needed).

    Grouped-query heads are handled by SDPA itself, so K/V are never copied per query head.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = LoraLinear(h, cfg.num_heads * cfg.head_dim, bias)
        self.k_proj = LoraLinear(h, cfg.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = LoraLinear(h, cfg.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = LoraLinear(cfg.num_heads * cfg.head_dim, h, False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, segments: Segments | None, attend: AttentionBackend) -> torch.Tensor:
        b, L, _ = x.shape
        q = self.q_proj(x, segments).view(b, L, self.num_heads, self.head_dim)
        k = self.k_proj(x, segments).view(b, L, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, segments).view(b, L, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        out = attend(self.layer_idx, q, k, v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, L, -1), segments)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoraLinear(h, i)
        self.up_proj = LoraLinear(h, i)
        self.down_proj = LoraLinear(i, h)

    def forward(self, x: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, segments)) * self.up_proj(x, segments), segments)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, segments: Segments | None, attend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, segments, attend)
        return h + self.mlp(self.post_attention_layernorm(h), segments)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope)


class CausalLM(nn.Module):
    """A decoder-only LM. ``hidden_states`` runs the trunk; ``lm_head`` maps to logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = LoraLinear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: Segments | None = None,
        attend: AttentionBackend = causal_attention,
    ) -> torch.Tensor:
        """tokens, positions: (b, L). ``segments`` index the flattened b*L rows. Returns (b, L, hidden)."""
        h = self.model.embed_tokens(tokens)
        cos, sin = self.model.rotary(positions, h.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, segments, attend, use_reentrant=False)
            else:
                h = layer(h, cos, sin, segments, attend)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        return self.lm_head(hidden, segments).float()

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[tuple[str, LoraLinear]]:
        """The (name, layer) pairs an adapter with these switches attaches to, in a fixed order."""
        names = (ATTN_TARGETS if attn else ()) + (MLP_TARGETS if mlp else ())
        out = []
        for i, layer in enumerate(self.model.layers):
            for n in names:
                part = "self_attn" if n in ATTN_TARGETS else "mlp"
                mod = getattr(getattr(layer, part), n)
                out.append((f"model.layers.{i}.{part}.{n}", mod))
        if unembed:
            out.append(("lm_head", self.lm_head))
        return out
