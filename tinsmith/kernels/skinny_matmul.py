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

A product over an adapter bank (a decode batch mixing adapters) also takes the bank's gathered
shrink of the same rows in its launch (:func:`matmul_shrinking`): the shrink's programs
(:func:`tinsmith.kernels.lora_gather.shrink_program`, its split and blocks, so the same bits) come
after the product's on the grid and run beside them, where a separate launch followed the product.
With 8 adapters that is three launches a layer fewer (q/k/v, o, gate/up; the down projection's
shrink is the SiLU product's already) and one for the unembedding.

:data:`BACKEND` is ``"torch"`` by default: the kernel has not been timed against cuBLAS on a GPU
yet. ``bench/gpu``'s ``skinny_products`` item times both on every decode projection of the 1.7B
shape and the decode step with each; where the kernel wins, ``"auto"`` turns it on for CUDA
tensors. The torch path is the CPU's and the reference the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinsmith.kernels import lora_gather, pdl, tickets
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
# Whether a decode product over an adapter bank takes the bank's gathered shrink in its launch
# (:func:`matmul_shrinking`); False: the shrink its own launch (benchmarks compare the two).
SHRINK_IN_PRODUCT = True
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
    def _product_program(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counter, pid_m, pid_n, split, M, N,
                         K: tl.constexpr, K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, stride_xm, stride_xk,
                         stride_wk, stride_wn, stride_ym, stride_yn, stride_ps, HAS_BIAS: tl.constexpr,
                         WIDEN: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """``y[m, n] = sum over k of x[m, k] * w[k, n] (+ bias[n])`` for one tile of ``BLOCK_M`` rows
        and ``BLOCK_N`` columns, over split ``s`` of the inputs (``[s*K_SPLIT, (s+1)*K_SPLIT)``). With
        ``SPLITS`` > 1 each program stores its fp32 partial (``part[s, m, n]``) and the tile's last
        program to finish adds them up in split order (``ticket_ptr``: the tile's count of finished
        programs, zero before and after: ``counter``). Rows are the grid's first axis, so a tile's programs for
        more rows than one tile holds read the same weights one after another (from L2). ``WIDEN``:
        16-bit operands multiplied as fp32 (Triton's interpreter multiplies bf16 wrongly; the
        products are the same, a bf16 value being exact in fp32)."""
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


    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, ticket_ptr, M, N, N_TILES, K: tl.constexpr,
                       K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, stride_xm, stride_xk, stride_wk, stride_wn,
                       stride_ym, stride_yn, stride_ps, a_ptr, idx_ptr, s_part_ptr, h_ptr, R: tl.constexpr,
                       S_K_SPLIT: tl.constexpr, S_SPLITS: tl.constexpr, stride_as, stride_ar, stride_ak, stride_sn,
                       stride_ss, stride_sr, stride_hn, stride_hr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SHRINK: tl.constexpr, R_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr, S_BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = False):
        """The product's programs (:func:`_product_program`: ``N_TILES`` column tiles a row tile, the
        grid's second axis) and, with ``SHRINK``, an adapter bank's gathered shrink of the same rows
        after them on that axis (``BLOCK_M x R_BLOCKS`` programs a row tile, each one row's block of
        ``BLOCK_R`` shrunk outputs: :func:`tinsmith.kernels.lora_gather.shrink_program`, its split
        ``S_SPLITS`` on the third axis). Each program's tickets count at ``pid_m * programs(1) + pid_n``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        counter = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
        if SHRINK:
            if pid_n < N_TILES:
                if split < SPLITS:
                    _product_program(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counter, pid_m, pid_n, split, M, N, K,
                                     K_SPLIT, SPLITS, stride_xm, stride_xk, stride_wk, stride_wn, stride_ym, stride_yn,
                                     stride_ps, HAS_BIAS, WIDEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
            else:
                pdl.wait(PDL)  # the rows first: see tinsmith.kernels.pdl
                t = pid_n - N_TILES
                row = pid_m * BLOCK_M + t // R_BLOCKS
                if (row < M) & (split < S_SPLITS):
                    lora_gather.shrink_program(x_ptr, a_ptr, idx_ptr, s_part_ptr, h_ptr, counter, row, t % R_BLOCKS,
                                               split, R, K, S_K_SPLIT, S_SPLITS, stride_xm, stride_xk, stride_as,
                                               stride_ar, stride_ak, stride_sn, stride_ss, stride_sr, stride_hn,
                                               stride_hr, S_SPLITS > 1, BLOCK_R, S_BLOCK_K)
        else:
            _product_program(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counter, pid_m, pid_n, split, M, N, K, K_SPLIT,
                             SPLITS, stride_xm, stride_xk, stride_wk, stride_wn, stride_ym, stride_yn, stride_ps,
                             HAS_BIAS, WIDEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, PDL)

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
    return _launch(x, w, bias, split, None)[0]


def matmul_shrinking_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, A_bank: torch.Tensor,
                            idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w (+ bias), h)`` in one launch, ``h`` (rows, R) fp32 the gathered shrink of the same
    rows through ``A_bank`` (positions, R, K) at each row's ``idx`` (-1: zeros): the same values,
    bit for bit, as :func:`tinsmith.kernels.lora_gather.shrink_triton` (its split and blocks, its
    partials added in its order), whose launch this saves."""
    y, h = _launch(x, w, bias, None, (A_bank, idx))
    assert h is not None
    return y, h


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, split: int | None,
            shrink: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    M, K = x.shape
    N = w.shape[1]
    cpu = x.device.type == "cpu"
    block_m, block_n, block_k, splits, k_split = plan(M, N, K, cpu, split)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(N, block_n)
    axis_2 = splits
    h = None
    shrink_args: tuple = (y, y, y, y, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)  # unread without a shrink
    shrink_const: dict = {"SHRINK": False, "R_BLOCKS": 1, "BLOCK_R": 16, "S_BLOCK_K": 16}
    tiles_1 = n_tiles
    if shrink is not None:
        A_bank, idx = shrink
        R = A_bank.shape[1]
        s_splits, s_k_split, block_r, s_block_k = lora_gather.shrink_plan(M, K, R, cpu, None)
        r_blocks = triton.cdiv(R, block_r)
        h = torch.empty(M, R, dtype=torch.float32, device=x.device)
        s_part = torch.empty(M, s_splits, R, dtype=torch.float32, device=x.device) if s_splits > 1 else h[:, None]
        shrink_args = (A_bank, idx, s_part, h, R, s_k_split, s_splits, A_bank.stride(0), A_bank.stride(1),
                       A_bank.stride(2), s_part.stride(0), s_part.stride(1), s_part.stride(2), h.stride(0),
                       h.stride(1))
        shrink_const = {"SHRINK": True, "R_BLOCKS": r_blocks, "BLOCK_R": block_r, "S_BLOCK_K": s_block_k}
        tiles_1 += block_m * r_blocks
        axis_2 = max(splits, s_splits)
    grid = (triton.cdiv(M, block_m), tiles_1, axis_2)
    counters = y  # unread where nothing takes tickets
    if axis_2 > 1:
        if not tickets.fits(grid[0] * grid[1]):
            raise ValueError(f"{grid[0] * grid[1]} output tiles are more than the tickets' {tickets.CAPACITY}")
        counters = tickets.counters(x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else y
    _skinny_kernel[grid](
        x, w, y if bias is None else bias, y, part, counters, M, N, n_tiles, K, k_split, splits, x.stride(0),
        x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1), M * N, *shrink_args,
        HAS_BIAS=bias is not None, WIDEN=cpu and x.dtype != torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **shrink_const, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.options(x))
    return y, h


# ----------------------------------------------------------------------------- dispatch
def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for ``x`` (rows, K) and ``w`` (K, N): the kernel where :func:`usable`,
    torch otherwise (and from then on once the kernel failed to build or launch here)."""
    if usable(x, w):
        y = GUARD.call(matmul_triton, x, w, bias, on=x)
        if y is not None:
            return y
    return matmul_torch(x, w, bias)


def matmul_shrinking(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, A_bank: torch.Tensor,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`matmul_shrinking_triton` where the kernel is usable for the product and the gathered
    LoRA kernels run (the shrink's own switch); None otherwise (the caller launches the shrink
    itself), and from then on once the kernel failed here."""
    if not (SHRINK_IN_PRODUCT and usable(x, w) and lora_gather.triton_usable(x) and A_bank.dtype == x.dtype):
        return None
    return GUARD.call(matmul_shrinking_triton, x, w, bias, A_bank, idx, on=x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` (out, in), ``x`` (..., in)), through :func:`matmul`
    where it takes the kernel."""
    if x.dim() < 2 or not allowed(x):
        return F.linear(x, weight, bias)
    x2, w = x.reshape(-1, x.shape[-1]), weight.t()
    if not usable(x2, w):
        return F.linear(x, weight, bias)
    return matmul(x2, w, bias).view(*x.shape[:-1], weight.shape[0])


__all__ = ["BACKEND", "GUARD", "MAX_ROWS", "allowed", "linear", "matmul", "matmul_shrinking",
           "matmul_shrinking_triton", "matmul_torch", "matmul_triton", "plan", "usable"]
