"""A decode step's products with the weights: a few rows by a large matrix, as one Triton kernel.

A decode step multiplies 1-256 rows by every weight matrix of the model once. That is bound by
reading the weights: on an H200 the 1.7B shape's products took 1.27 ms of a 64-row step's 2.23 ms
of kernels, about 64% of the device's measured copy rate (docs/performance.md, second GPU run).
Two things cost a library GEMM there that this kernel does differently:

- **Too few programs.** Tiles of 64-128 output columns give a 2,048-wide output (the attention's
  output projection, the MLP's down projection) 16-32 programs on 132 SMs. Here the reduction is
  split over up to :data:`MAX_SPLIT` programs (split-K) so that about :data:`PROGRAMS` programs
  read the weights, and the last program of each output tile to finish adds the partial sums up in
  split order (:mod:`tinsmith.kernels.tickets`): one launch, the same result whichever program came
  last, so a replayed CUDA graph equals the eager step and seeded runs repeat bit for bit. A split
  is never shorter than :data:`MIN_K_SPLIT` inputs: the fp32 partials it writes and reads back cost
  ``2 * rows / split length`` of its weights' bytes (a quarter at 64 rows and 512 inputs).
- **Waiting before reading.** Launched dependent on the kernel before (:mod:`tinsmith.kernels.pdl`),
  a program loads its first block of weights *before* it waits for that kernel: nothing a decode
  step runs writes the weights, so that read can overlap the end of the norm or attention kernel
  whose output it multiplies. The wait comes before the rows are read. (A kernel that is not
  launched dependent, as torch's are, lets the next start only once it completed: the early read
  can only overlap this package's decode kernels, none of which writes weights.)

``y = x @ w (+ bias)`` for ``x`` (rows, K) and ``w`` (K, N) of any strides (a packed projection's
``(in, out)`` buffer, or a ``(out, in)`` weight's transpose such as the unembedding's), products in
fp32 (fp32 inputs exactly: ``input_precision="ieee"``), ``y`` in ``x``'s dtype. Outside autograd
only: training keeps torch's GEMMs and their backward.

:data:`BACKEND` is ``"torch"`` by default: the kernel has not been timed against cuBLAS on a GPU
yet. ``bench/gpu``'s ``skinny_products`` item times both on every decode projection of the 1.7B
shape and the decode step with each; where the kernel wins, ``"auto"`` turns it on for CUDA
tensors. The torch path is the CPU's and the reference the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinsmith.kernels import pdl, tickets
from tinsmith.kernels.guard import KernelGuard

try:  # optional: ``pip install 'tinsmith[gpu]'``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# "torch": torch's matmul (cuBLAS on a GPU) for every product; "auto": the kernel for CUDA tensors
# of at most MAX_ROWS rows outside autograd; "triton": the kernel for every such tensor (CPU ones
# need TRITON_INTERPRET=1 set before triton is imported: tests do).
BACKEND = "torch"
# Products of more rows than this (a prefill, a training forward) stay torch's: with enough rows
# a library GEMM fills the GPU and reads each weight once per tile row anyway.
MAX_ROWS = 256
# Aim for about this many programs (4 per SM on an H200's 132), and never split a reduction into
# more than MAX_SPLIT parts or parts of fewer than MIN_K_SPLIT inputs. Not yet tuned on a GPU:
# bench/gpu's skinny_products item sweeps them.
PROGRAMS = 512
MAX_SPLIT = 8
MIN_K_SPLIT = 512
# Output columns and inputs a program takes at a time on a GPU, its warps, and the blocks of weights
# its loop keeps in flight (Triton's software pipelining: bytes in flight are what a product bound
# by reading needs).
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
# Widest block on a CPU, where the interpreter runs one NumPy pass per program and loop trip: wide
# blocks keep it quick (tests narrow them to run the GPU's blocking and splits on small shapes).
CPU_MAX_BLOCK = 256

GUARD = KernelGuard("skinny matmul kernel", "torch's matmul")


def triton_available() -> bool:
    return triton is not None


def allowed(x: torch.Tensor) -> bool:
    """Whether the switch allows the kernel on ``x``'s device, it has not failed there, and no
    gradient is wanted (checked before any shape: every projection asks)."""
    return triton is not None and GUARD.allows(BACKEND, x) and not torch.is_grad_enabled()


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`matmul` takes the kernel for ``x`` (rows, K) by ``w`` (K, N): :func:`allowed`,
    the rows are few and both are of one floating dtype."""
    return (allowed(x) and x.dim() == 2 and w.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[1] == w.shape[0] > 0
            and w.shape[1] > 0)


# ----------------------------------------------------------------------------- torch (reference, CPU)
def matmul_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)``."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


# ----------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K: tl.constexpr,
                       K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, stride_xm, stride_xk, stride_wk, stride_wn,
                       stride_ym, stride_yn, stride_ps, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
                       PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """``y[m, n] = sum over k of x[m, k] * w[k, n] (+ bias[n])`` for one tile of ``BLOCK_M`` rows
        and ``BLOCK_N`` columns, over split ``s`` of the inputs (``[s*K_SPLIT, (s+1)*K_SPLIT)``). With
        ``SPLITS`` > 1 each program stores its fp32 partial (``part[s, m, n]``) and the tile's last
        program to finish adds them up in split order (``ticket_ptr``: the tile's count of finished
        programs, zero before and after). Rows are the grid's first axis, so a tile's programs for
        more rows than one tile holds read the same weights one after another (from L2). ``WIDEN``:
        16-bit operands multiplied as fp32 (Triton's interpreter multiplies bf16 wrongly; the
        products are the same, a bf16 value being exact in fp32)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_first = split * K_SPLIT
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        # The first block of weights is read before the wait: no decode kernel writes weights.
        offs_k = k_first + tl.arange(0, BLOCK_K)
        w = tl.load(w_cols + offs_k[:, None].to(tl.int64) * stride_wk, mask=(offs_k < K)[:, None] & n_mask[None, :],
                    other=0.0)
        pdl.wait(PDL)  # then the rows, which the kernel before may have written: see tinsmith.kernels.pdl
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if WIDEN:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), input_precision=PRECISION)
        for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):
            offs_k = k_first + k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_cols + offs_k[:, None].to(tl.int64) * stride_wk, mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if WIDEN:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        mn_mask = m_mask[:, None] & n_mask[None, :]
        y_tile = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
        if SPLITS == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)
        else:
            partials = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(partials + split * stride_ps, acc, mask=mn_mask)
            counter = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
            ticket = tickets.take(counter)
            # the ticket compared per element: a scalar ANDed into a mask is not a mask dtype every
            # Triton version's interpreter takes
            last = mn_mask & ((offs_m[:, None] * 0 + offs_n[None, :] * 0 + ticket) == SPLITS - 1)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLITS):  # split order, whichever program came last
                total += tl.load(partials + s * stride_ps, mask=last, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_tile, total.to(y_ptr.dtype.element_ty), mask=last)
            tickets.hand_back(counter, ticket, SPLITS, BLOCK_N)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def plan(M: int, N: int, K: int, cpu: bool = False, split: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, inputs a split) of a product of ``M`` rows by a ``K x N``
    matrix: enough splits for about :data:`PROGRAMS` programs, at most :data:`MAX_SPLIT`, none
    shorter than :data:`MIN_K_SPLIT` inputs or one block (``split`` overrides the count, within the
    blocks; benchmarks sweep it). Shapes only, so a captured decode step keeps its grid."""
    cap = CPU_MAX_BLOCK if cpu else None
    block_m = _pow2(M, 16, 64)
    block_n = _pow2(N, 16, cap or BLOCK_N)
    block_k = _pow2(K, 16, cap or BLOCK_K)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    blocks = triton.cdiv(K, block_k)
    if split is None:
        most = min(MAX_SPLIT, max(1, K // MIN_K_SPLIT))
        split = min(triton.cdiv(PROGRAMS, tiles), most) if tickets.fits(tiles) else 1
    split = max(1, min(split, blocks))
    k_split = triton.cdiv(blocks, split) * block_k
    return block_m, block_n, block_k, triton.cdiv(K, k_split), k_split


def matmul_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  split: int | None = None) -> torch.Tensor:
    """:func:`matmul_torch` as the kernel (CUDA; interpreted for CPU tensors), ``split`` as
    :func:`plan` takes it."""
    M, K = x.shape
    N = w.shape[1]
    block_m, block_n, block_k, splits, k_split = plan(M, N, K, x.device.type == "cpu", split)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    if splits > 1:
        if not tickets.fits(grid[0] * grid[1]):
            raise ValueError(f"{grid[0] * grid[1]} output tiles are more than the tickets' {tickets.CAPACITY}")
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        counters = tickets.counters(x.device)
    else:
        part = counters = y  # unread
    _skinny_kernel[grid](
        x, w, y if bias is None else bias, y, part, counters, M, N, K, k_split, splits, x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), y.stride(0), y.stride(1), M * N, HAS_BIAS=bias is not None,
        WIDEN=x.device.type == "cpu" and x.dtype != torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.options(x))
    return y


# ----------------------------------------------------------------------------- dispatch
def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for ``x`` (rows, K) and ``w`` (K, N): the kernel where :func:`usable`,
    torch otherwise (and from then on once the kernel failed to build or launch here)."""
    if usable(x, w):
        y = GUARD.call(matmul_triton, x, w, bias, on=x)
        if y is not None:
            return y
    return matmul_torch(x, w, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` (out, in), ``x`` (..., in)), through :func:`matmul`
    where it takes the kernel."""
    if x.dim() < 2 or not allowed(x):
        return F.linear(x, weight, bias)
    x2, w = x.reshape(-1, x.shape[-1]), weight.t()
    if not usable(x2, w):
        return F.linear(x, weight, bias)
    return matmul(x2, w, bias).view(*x.shape[:-1], weight.shape[0])


__all__ = ["BACKEND", "GUARD", "MAX_ROWS", "allowed", "linear", "matmul", "matmul_torch", "matmul_triton", "plan", "usable"]
