"""Gathered LoRA ops: every row of a batch through its own adapter, in one call per projection.

A decode batch mixes adapters row by row. Rather than one small matmul pair per adapter, the
adapters of a layer sit in stacked banks (``A_bank[slots, r, in]``, ``B_bank[slots, out, r]``
with the scale folded into B, ranks zero-padded to the bank's) and each row carries the bank
slot it reads (``idx[row]``, -1 for no adapter):

- ``shrink(x, A_bank, idx) -> h``: ``h[i] = A_bank[idx[i]] @ x[i]``, (rows, r) in fp32;
- ``expand(y, h, B_bank, idx)``: ``y[i] += B_bank[idx[i]] @ h[i]`` in place (``y`` may be a view,
  e.g. one projection's columns of a packed q/k/v output);
- ``expand_parts(y, h, B_bank, idx, columns, h_offsets)``: the same for projections that share an
  input (q/k/v): ``h`` holds every part's shrunk vector side by side (one shrink over their
  stacked A), and each output column reads its own part's (``h_offsets[column]`` on, ``r`` wide),
  so the whole packed output takes one launch.

Shapes depend only on the number of rows, and nothing reads back to the host, so a decode step
built on them can be captured in a CUDA graph. The Triton kernels are the BGMV scheme of
Punica/S-LoRA (one program per row and block of output columns, a loop over the reduced
dimension, fp32 accumulation): at decode sizes the work is reading each row's adapter, which a
per-row matrix-vector product does once. The torch functions are the CPU path and the
reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import guard
from tinsmith.kernels.guard import KernelGuard

try:  # optional: ``pip install 'tinsmith[gpu]'``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


# "auto": the Triton kernels for CUDA tensors, torch for the rest; "torch"; "triton": the kernels
# for every tensor (CPU ones need TRITON_INTERPRET=1 set before triton is imported: tests do).
BACKEND = "auto"


def triton_available() -> bool:
    """True when Triton is installed."""
    return triton is not None


triton_interpreting = guard.triton_interpreting  # asked here by the kernels' users and tests
GUARD = KernelGuard("gathered LoRA kernels", "gathering adapters in torch")


def triton_usable(x: torch.Tensor) -> bool:
    """Whether :func:`shrink`/:func:`expand` take the Triton path for tensors like ``x`` (not once
    the kernels failed to build or launch here: :data:`GUARD`)."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None:
        return False
    return BACKEND == "triton" or x.device.type == "cuda"


# ----------------------------------------------------------------------------- torch (reference, CPU)
def shrink_torch(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``A_bank[idx[i]] @ x[i]`` per row, zeros where ``idx`` is -1; (rows, r) fp32."""
    live = idx >= 0
    A = A_bank.index_select(0, idx.clamp(min=0))  # (rows, r, in)
    h = torch.bmm(A, x.to(A.dtype).unsqueeze(-1)).squeeze(-1).float()
    return torch.where(live[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))


def expand_torch(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor) -> None:
    """``y[i] += B_bank[idx[i]] @ h[i]`` in place, nothing where ``idx`` is -1."""
    live = idx >= 0
    B = B_bank.index_select(0, idx.clamp(min=0))  # (rows, out, r)
    d = torch.bmm(B, h.to(B.dtype).unsqueeze(-1)).squeeze(-1)
    y.add_(torch.where(live[:, None], d, torch.zeros((), dtype=d.dtype, device=d.device)).to(y.dtype))


def expand_parts_torch(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor,
                       columns: list[tuple[int, int]]) -> None:
    """:func:`expand_torch` per part: columns ``[a, b)`` of part ``j`` read ``h[:, j*r:(j+1)*r]``."""
    r = B_bank.shape[2]
    for j, (a, b) in enumerate(columns):
        expand_torch(y[:, a:b], h[:, j * r:(j + 1) * r], B_bank[:, a:b], idx)


# ----------------------------------------------------------------------------- Triton (BGMV)
# The reduced and output sizes are compile-time constants: each layer has fixed ones, so a model
# compiles a handful of variants, and loop bounds are known to the compiler (Triton's
# interpreter, which tests run the kernels in on a CPU, needs them so too).
if triton is not None:

    @triton.jit
    def _bgmv_kernel(v_ptr, m_ptr, idx_ptr, voff_ptr, out_ptr, O: tl.constexpr, K: tl.constexpr,
                     stride_vn, stride_vk, stride_ms, stride_mo, stride_mk, stride_on, stride_oo,
                     ACCUMULATE: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """``out[row] (+)= M[idx[row]] @ v[row]`` for one row and block of outputs: shrink stores
        (zeros for slot -1), expand accumulates into ``out`` (left as it is for slot -1).
        ``SEGMENTED``: output ``o`` reads ``v[row, voff[o]:voff[o] + K]`` (packed projections)."""
        row = tl.program_id(0)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        slot = tl.load(idx_ptr + row).to(tl.int64)
        o_mask = offs_o < O
        if ACCUMULATE:
            # the slot compared per element (a scalar condition ANDed into a mask is not a mask
            # dtype every Triton version's interpreter accepts)
            o_mask = o_mask & ((offs_o * 0 + slot) >= 0)
        m_rows = m_ptr + tl.maximum(slot, 0) * stride_ms + offs_o[:, None] * stride_mo
        v_row = v_ptr + row.to(tl.int64) * stride_vn
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        if SEGMENTED:
            voff = tl.load(voff_ptr + offs_o, mask=offs_o < O, other=0).to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = (offs_k < K) & ((offs_k * 0 + slot) >= 0)
            mask2 = o_mask[:, None] & k_mask[None, :]
            mv = tl.load(m_rows + offs_k[None, :] * stride_mk, mask=mask2, other=0.0).to(tl.float32)
            if SEGMENTED:
                vv2 = tl.load(v_row + (voff[:, None] + offs_k[None, :]) * stride_vk, mask=mask2,
                              other=0.0).to(tl.float32)
                acc += tl.sum(mv * vv2, axis=1)
            else:
                vv = tl.load(v_row + offs_k * stride_vk, mask=k_mask, other=0.0).to(tl.float32)
                acc += tl.sum(mv * vv[None, :], axis=1)
        out_cols = out_ptr + row.to(tl.int64) * stride_on + offs_o * stride_oo
        if ACCUMULATE:
            acc += tl.load(out_cols, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(out_cols, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _bgmv(v: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, K: int, accumulate: bool,
          block_o: int, block_k: int, v_offsets: torch.Tensor | None = None) -> None:
    """Launch :func:`_bgmv_kernel`: ``bank`` is (slots, outputs, reduced), ``v`` (rows, reduced),
    ``out`` (rows, outputs); ``K`` the reduced size; ``v_offsets`` (outputs,): where in ``v``
    each output's reduced vector starts (packed projections)."""
    O = out.shape[1]
    _bgmv_kernel[(v.shape[0], triton.cdiv(O, block_o))](
        v, bank, idx, idx if v_offsets is None else v_offsets, out, O, K, v.stride(0), v.stride(1),
        bank.stride(0), bank.stride(1), bank.stride(2), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, SEGMENTED=v_offsets is not None, BLOCK_O=block_o, BLOCK_K=block_k)


def shrink_triton(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """:func:`shrink_torch` as one BGMV kernel (CUDA; interpreted for CPU tensors)."""
    n, K = x.shape
    R = A_bank.shape[1]
    h = torch.empty(n, R, dtype=torch.float32, device=x.device)
    if n == 0:
        return h
    cpu = x.device.type == "cpu"
    block_r = _pow2(R, 16, 64)
    # Wide K blocks on CPU: the interpreter runs one NumPy pass per loop trip.
    block_k = _pow2(K, 16, 1024 if cpu else 128)
    _bgmv(x, A_bank, idx, h, K, False, block_r, block_k)
    return h


def expand_triton(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor,
                  h_offsets: torch.Tensor | None = None) -> None:
    """:func:`expand_torch` (with ``h_offsets``: :func:`expand_parts_torch`) as one BGMV kernel
    (CUDA; interpreted for CPU tensors)."""
    n, N = y.shape
    R = B_bank.shape[2]
    if n == 0:
        return
    cpu = y.device.type == "cpu"
    block_r = _pow2(R, 16, 64)
    block_n = _pow2(N, 16, 1024 if cpu else 128)
    _bgmv(h, B_bank, idx, y, R, True, block_n, block_r, h_offsets)


# ----------------------------------------------------------------------------- dispatch
def shrink(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(rows, r) fp32: each row's ``x`` through its slot's A (zeros for slot -1). Triton where usable."""
    if triton_usable(x):
        out = GUARD.call(shrink_triton, x, A_bank, idx, on=x)
        if out is not None:
            return out
    return shrink_torch(x, A_bank, idx)


def _ran(kernel, *args) -> bool:
    kernel(*args)
    return True


def expand(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor) -> None:
    """Add each row's ``B_bank[slot] @ h`` into ``y`` in place (nothing for slot -1). Triton where usable."""
    if not (triton_usable(y) and GUARD.call(_ran, expand_triton, y, h, B_bank, idx, on=y)):
        expand_torch(y, h, B_bank, idx)


def expand_parts(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor,
                 columns: list[tuple[int, int]], h_offsets: torch.Tensor) -> None:
    """:func:`expand` for packed projections: columns ``[a, b)`` of part ``j`` read part ``j`` of
    ``h`` (``h_offsets`` says so per column, for the kernel). One launch where Triton is usable."""
    if not (triton_usable(y) and GUARD.call(_ran, expand_triton, y, h, B_bank, idx, h_offsets, on=y)):
        expand_parts_torch(y, h, B_bank, idx, columns)
