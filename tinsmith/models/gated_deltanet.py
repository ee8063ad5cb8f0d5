"""Gated DeltaNet: the linear-attention layers of Qwen3.5's hybrid decoder, in plain PyTorch.

Per value head the layer keeps a ``key_dim x value_dim`` state ``S``; each token decays it by
``exp(g)``, then writes the delta-rule correction ``k (beta (v - S^T k))^T`` and reads
``S^T q``. Training and prefill run the chunked form (chunks of 64 tokens: the within-chunk
updates are solved as one unit-triangular system, the state is carried from chunk to chunk),
decode runs the one-token recurrence over the state kept per sampler row. Both follow
transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (the fla
and causal-conv1d CUDA kernels are not used). q, k and v first pass a short causal depthwise
convolution (kernel ``linear_conv_kernel_dim``) whose last inputs are the other per-row state.

Module and parameter names are transformers' (``linear_attn.in_proj_qkv``...), so checkpoints
and PEFT adapters line up; the projections are :class:`LoraLinear` LoRA targets.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from tinsmith.kernels import delta_rule
from tinsmith.models.config import ModelConfig
from tinsmith.models.lora import LoraLinear, PackedProjection, RowGroups, Segments

CHUNK = 64
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


class RecurrentStates(Protocol):
    """What a sampling backend offers Gated DeltaNet layers (the attribute ``recurrent`` of it).

    While prefilling (``decoding`` False) rows are right-padded: ``valid`` (b, L) marks real
    tokens and ``record`` keeps each layer's final states; ``initial`` gives the states a prefill
    continues from (the chunks before it of a long prompt), None to start from zeros. While
    decoding (one token per row)
    ``get`` returns a layer's (conv inputs (n, conv_dim, kernel - 1), delta-rule state
    (n, value_heads, key_dim, value_dim)) and ``put`` stores the advanced ones; ``gate`` zeroes
    the decay and write strength of rows whose state the step must leave as it is (the padding
    rows of a fixed-shape step).
    """

    decoding: bool
    valid: torch.Tensor | None

    def record(self, layer_idx: int, conv_inputs: torch.Tensor, state: torch.Tensor) -> None: ...
    def initial(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def put(self, layer_idx: int, conv_state: torch.Tensor, state: torch.Tensor) -> None: ...
    def gate(self, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's normalisation: ``x / sqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Heads first, fp32, q/k L2-normalised (q also by sqrt(key_dim)), q/k repeated per value head."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole sequences, chunked.

    q, k: (b, L, key_heads, dk); v: (b, L, value_heads, dv); g (log decay, <= 0), beta: (b, L,
    value_heads). Returns the output (b, L, value_heads, dv) in v's dtype and the final state
    (b, value_heads, dk, dv) in fp32.
    """
    dtype, (b, L) = v.dtype, v.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (chunk - L % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    H, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    n = (L + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(b, H, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(b, H, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # Within a chunk the updates form a unit lower-triangular system (I + tril(beta k k^T decay)).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, H, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n):
        v_new = values[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(b, H, n * chunk, dv)[:, :, :L]
    return out.transpose(1, 2).to(dtype), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: shapes as :func:`chunk_gated_delta_rule` with L = 1; ``state`` (b, H, dk, dv)
    fp32. Returns (output (b, 1, H, dv), new state)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q, k, v, g, beta = q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0]
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out[:, None].to(dtype), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times ``silu(z)`` (transformers' ``RMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        la = cfg.linear_attn
        assert la is not None
        self.layer_idx = layer_idx
        self.nk, self.nv, self.dk, self.dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        self.kernel = la.conv_kernel
        h, c, value_dim = cfg.hidden_size, la.conv_dim, la.num_value_heads * la.value_head_dim
        self.in_proj_qkv = LoraLinear(h, c)
        self.in_proj_z = LoraLinear(h, value_dim)
        self.in_proj_b = LoraLinear(h, self.nv)
        self.in_proj_a = LoraLinear(h, self.nv)
        self.out_proj = LoraLinear(value_dim, h)
        self.conv1d = nn.Conv1d(c, c, self.kernel, groups=c, bias=False, padding=self.kernel - 1)
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        # Set by ``pack_weights``: the four input projections as views of one buffer (one GEMM at inference).
        self.packed_in: PackedProjection | None = None

    def _project(self, x: torch.Tensor, segments: Segments | RowGroups | None):
        """(qkv before the convolution, z, b, a) of ``x`` (b, L, hidden)."""
        packed = self.packed_in
        if packed is not None and not torch.is_grad_enabled() and packed.intact():
            y = packed.project(x.reshape(-1, x.shape[-1]), segments).view(*x.shape[:-1], -1)
            return tuple(y[..., a:b] for a, b in packed.columns)
        return tuple(p(x, segments) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | None, attend: object) -> torch.Tensor:
        b, L, _ = x.shape
        mixed, z, b_in, a_in = self._project(x, segments)  # mixed: (b, L, conv_dim), before the convolution
        beta = b_in.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a_in.float() + self.dt_bias)
        states: RecurrentStates | None = getattr(attend, "recurrent", None)
        weight = self.conv1d.weight
        if states is not None and states.decoding:
            g, beta = states.gate(g, beta)  # padding rows of a fixed-shape step: their state stays
            conv_state, state = states.get(self.layer_idx)
            window = torch.cat((conv_state, mixed.transpose(1, 2).to(conv_state.dtype)), dim=-1)  # (n, C, kernel)
            conv = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0])).transpose(1, 2)
            q, k, v = self._split(conv.to(x.dtype), b, L)
            out = delta_rule.try_decode_step_(q, k, v, g, beta, state) if delta_rule.usable(state) else None
            if out is None:  # the torch step (CPUs; a GPU whose Triton cannot build the fused kernel)
                out, state = recurrent_gated_delta_step(q, k, v, g, beta, state)
            states.put(self.layer_idx, window[:, :, 1:], state)
        else:
            if states is not None and states.valid is not None:
                # Right padding must not touch the state: no decay (g = 0), no write (beta = 0).
                g, beta = g * states.valid[..., None], beta * states.valid[..., None]
            # A packed training row (documents end to end, see document_attention): the recurrence
            # runs over the documents as right-padded rows, so none carries state into the next.
            packed = states is None and hasattr(attend, "unpad")
            if packed:
                mixed, g, beta = attend.pad(mixed), attend.pad(g), attend.pad(beta)  # type: ignore[attr-defined]
            rows, length = mixed.shape[:2]
            start = states.initial(self.layer_idx) if states is not None else None
            if start is None:
                conv = F.conv1d(mixed.transpose(1, 2).to(weight.dtype), weight, padding=self.kernel - 1,
                                groups=weight.shape[0])[..., :length]
                initial_state = None
            else:  # continue a prefill: the convolution sees the earlier chunk's last inputs
                conv_state, initial_state = start
                window = torch.cat((conv_state, mixed.transpose(1, 2).to(conv_state.dtype)), dim=-1)
                conv = F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0])
            q, k, v = self._split(F.silu(conv).transpose(1, 2).to(x.dtype), rows, length)
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state)
            if packed:
                out = attend.unpad(out)  # type: ignore[attr-defined]
            if states is not None:
                states.record(self.layer_idx, mixed, state)
        out = self.norm(out, z.view(b, L, self.nv, self.dv)).reshape(b, L, -1)
        return self.out_proj(out, segments)

    def _split(self, conv: torch.Tensor, b: int, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key_dim = self.nk * self.dk
        q, k, v = conv.split([key_dim, key_dim, self.nv * self.dv], dim=-1)
        return (q.reshape(b, L, self.nk, self.dk), k.reshape(b, L, self.nk, self.dk),
                v.reshape(b, L, self.nv, self.dv))
