"""One decode step of the gated delta rule (Gated DeltaNet), fused and in place.

A hybrid model's linear layers keep, per sampler row and value head, a ``key_dim x value_dim``
fp32 state (Qwen3.5: 32 heads of 128 x 128, 2 MB per row and layer). A decode step decays it,
reads it against the new key, writes the correction back and reads it against the query. In
torch (:func:`tinsmith.models.gated_deltanet.recurrent_gated_delta_step`, the CPU path and the
reference) that is half a dozen whole passes over the state plus temporaries, and the sampler
then copies the new state into its rows: at 64 rows the states, not the weights, are what the
step spends its memory traffic on. Here one program per (row, value head, block of value
columns) reads its tile of the state once, does every update in registers and writes it back
in place, as fla's fused recurrent kernel does:

    S = S * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  out = S^T q

with q and k L2-normalised in the kernel (q also by ``key_dim ** -0.5``), each value head
reading key head ``head // (value_heads / key_heads)``.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import pdl
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors, torch for the rest; "torch"; "triton": the kernel for
# every tensor (CPU ones need TRITON_INTERPRET=1 set before triton is imported: tests do).
BACKEND = "auto"
L2_EPS = 1e-6  # fla's (and tinsmith.models.gated_deltanet.l2norm's)
GUARD = KernelGuard("fused delta-rule decode kernel", "decoding Gated DeltaNet layers in torch")


def usable(state: torch.Tensor) -> bool:
    """Whether a decode step over ``state`` takes the kernel (it must be fp32 and contiguous per head)."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None or state.dtype != torch.float32:
        return False
    if state.stride(-1) != 1 or state.stride(-2) != state.shape[-1]:
        return False
    return BACKEND == "triton" or state.device.type == "cuda"


if triton is not None:

    @triton.jit
    def _step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr,
                     stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh,
                     stride_bn, stride_bh, stride_sn, stride_sh, stride_on, stride_oh, q_scale, eps,
                     REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        keys = tl.arange(0, BLOCK_K)
        k_mask, v_mask = keys < DK, cols < DV
        kh = head // REP
        q = tl.load(q_ptr + row * stride_qn + kh * stride_qh + keys, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_kn + kh * stride_kh + keys, mask=k_mask, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * q_scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(v_ptr + row * stride_vn + head * stride_vh + cols, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gn + head * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_bn + head * stride_bh).to(tl.float32)
        tile = s_ptr + row * stride_sn + head * stride_sh + keys[:, None] * DV + cols[None, :]
        mask = k_mask[:, None] & v_mask[None, :]
        s = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(tile, s, mask=mask)
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + row * stride_on + head * stride_oh + cols, out.to(o_ptr.dtype.element_ty), mask=v_mask)


def decode_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor) -> torch.Tensor:
    """One token per row, the state advanced in place; shapes as
    :func:`tinsmith.models.gated_deltanet.recurrent_gated_delta_step`: q, k (b, 1, key_heads, dk),
    v (b, 1, value_heads, dv), g, beta (b, 1, value_heads), state (b, value_heads, dk, dv) fp32.
    Returns the output (b, 1, value_heads, dv) in v's dtype."""
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    out = torch.empty(b, 1, hv, dv, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    q3, k3, v3, o3 = q[:, 0], k[:, 0], v[:, 0], out[:, 0]
    g2, b2 = g[:, 0], beta[:, 0]
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    if k3.stride(-1) != 1:
        k3 = k3.contiguous()
    if v3.stride(-1) != 1:
        v3 = v3.contiguous()
    block_k = max(16, triton.next_power_of_2(dk))
    # A tile of key_dim x block_v fp32 values per program: 128 x 32 keeps it in registers on a GPU.
    block_v = min(max(16, triton.next_power_of_2(dv)), 32 if state.is_cuda else 128)
    _step_kernel[(b, hv, triton.cdiv(dv, block_v))](
        q3, k3, v3, g2, b2, state, o3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        g2.stride(0), g2.stride(1), b2.stride(0), b2.stride(1), state.stride(0), state.stride(1),
        o3.stride(0), o3.stride(1), dk ** -0.5, L2_EPS,
        REP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, **pdl.options(state))
    return out


def try_decode_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor | None:
    """:func:`decode_step_`, or None (the caller takes the torch step; ``state`` untouched) where the
    kernel cannot run: the first failure to build it on a GPU is logged, and torch serves from then on."""
    return GUARD.call(decode_step_, q, k, v, g, beta, state, on=state)
