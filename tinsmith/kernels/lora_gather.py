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
per-row matrix-vector product does once.

The shrink reduces the input size (thousands) down to a few dozen outputs: one program per row
and block of outputs would leave most of a GPU idle (64 rows: 64-128 programs on 132 SMs), each
walking the whole input serially, latency bound. So the reduction is split (split-K): ``split``
programs per row and block each reduce a slice of the input into an fp32 partial sum, and the
last of them to finish adds the partials up, in split order: each program stores its partial and
then takes a ticket (an atomic count per row and block, which the last one sets back to zero), so
the sum needs no second launch (a small torch sum of about 2 us on an H200, four a layer, was one
before). The atomics only count: every sum is taken in the same order whatever the scheduling, so
a graph-replayed step equals the eager one and seeded runs repeat bit for bit
(:mod:`tinsmith.kernels.tickets`). Where there are more rows than counters, torch adds the
partials. ``split`` depends only on the shapes (rows, rank, input size). Summing the partials in the expand instead was slower on an H200: the
expand runs thousands of programs (rows x output blocks) and each summed them again; at 256 rows
an expand took 3-4x as long. The torch functions are the CPU path and the reference the kernels
are tested against.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import guard, pdl, tickets
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


# ----------------------------------------------------------------------------- Triton (BGMV, split-K shrink)
# The reduced and output sizes are compile-time constants: each layer has fixed ones, so a model
# compiles a handful of variants, and loop bounds are known to the compiler (Triton's
# interpreter, which tests run the kernels in on a CPU, needs them so too).

# The shrink's split: None picks it per shape (:func:`shrink_split`); 1 is one program per row and
# block of outputs walking the whole input, the grid before split-K (benchmarks compare the two).
SHRINK_SPLIT: int | None = None
# Aim for about this many shrink programs. On an H200 (132 SMs; CUDA-graph replay, bf16, rank 32,
# 8 adapters, the partials' sum included), 64 rows' shrinks were fastest near 512 programs: q/k/v
# packed 9.4 -> 8.0 us (split 4), o 7.4 -> 5.4, gate/up 9.4 -> 6.3, down 18.9 -> 8.1 (split 8).
# At 256 rows (256-512 programs unsplit) only the down projection gained (21.4 -> 18.4, split 2).
SHRINK_PROGRAMS = 512
# More partials than this gained nothing there, and summing them costs more.
SHRINK_MAX_SPLIT = 8
# Outputs an expand program writes (a row's block of columns) on a GPU: 64 rows of q/k/v packed
# make 2,048 programs at 128. Not yet timed against other widths (bench/gpu's lora_gather sweeps it).
EXPAND_BLOCK = 128
# Widest block on a CPU, where the interpreter runs one NumPy pass per loop trip and program: wide
# blocks keep it quick (tests narrow it to run the GPU's blocking and many splits on small shapes).
CPU_MAX_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _bgmv_shrink_kernel(x_ptr, a_ptr, idx_ptr, out_ptr, h_ptr, ticket_ptr, R: tl.constexpr, K: tl.constexpr,
                            K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, stride_xn, stride_xk, stride_as, stride_ar,
                            stride_ak, stride_on, stride_os, stride_or, stride_hn, stride_hr, SUM: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """One program of :func:`shrink_program` per row, block of ``BLOCK_R`` outputs and split."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0)
        shrink_program(x_ptr, a_ptr, idx_ptr, out_ptr, h_ptr, ticket_ptr + row * tl.num_programs(1) + tl.program_id(1),
                       row, tl.program_id(1), tl.program_id(2), R, K, K_SPLIT, SPLITS, stride_xn, stride_xk, stride_as,
                       stride_ar, stride_ak, stride_on, stride_os, stride_or, stride_hn, stride_hr, SUM, BLOCK_R,
                       BLOCK_K)

    @triton.jit
    def shrink_program(x_ptr, a_ptr, idx_ptr, out_ptr, h_ptr, counter, row, r_block, split, R: tl.constexpr,
                       K: tl.constexpr, K_SPLIT: tl.constexpr, SPLITS: tl.constexpr, stride_xn, stride_xk, stride_as,
                       stride_ar, stride_ak, stride_on, stride_os, stride_or, stride_hn, stride_hr, SUM: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """``out[row, s, o] = sum over k in split s of A[idx[row], o, k] * x[row, k]`` for one row,
        block ``r_block`` of ``BLOCK_R`` outputs and split ``s`` (inputs ``[s*K_SPLIT,
        (s+1)*K_SPLIT)``); zeros for slot -1. With ``SUM``, the row and block's last program to
        finish also writes ``h[row, o]``, the partials added in split order (``counter``: the row
        and block's count of finished programs, zero before and after). The caller has waited for
        the kernel before (:mod:`tinsmith.kernels.pdl`); the skinny-product kernel runs it too
        (:mod:`tinsmith.kernels.skinny_matmul`)."""
        offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        slot = tl.load(idx_ptr + row).to(tl.int64)
        r_mask = offs_r < R
        a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + offs_r[:, None] * stride_ar
        x_row = x_ptr + row.to(tl.int64) * stride_xn
        k_first = split * K_SPLIT
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            offs_k = k_first + k0 + tl.arange(0, BLOCK_K)
            # Slot -1 loads nothing and stores zeros. The slot is compared per element: a scalar
            # condition ANDed into a mask is not a mask dtype every Triton version's interpreter accepts.
            k_mask = (offs_k < K) & ((offs_k * 0 + slot) >= 0)
            a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            xv = tl.load(x_row + offs_k * stride_xk, mask=k_mask, other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        partials = out_ptr + row.to(tl.int64) * stride_on + offs_r * stride_or
        tl.store(partials + split * stride_os, acc, mask=r_mask)
        if SUM:
            ticket = tickets.take(counter)
            last = (offs_r * 0 + ticket) == SPLITS - 1  # per element, as the slot above
            total = tl.zeros([BLOCK_R], dtype=tl.float32)
            for s in range(SPLITS):  # split order, whichever program came last
                total += tl.load(partials + s * stride_os, mask=r_mask & last, other=0.0, cache_modifier=".cg")
            tl.store(h_ptr + row.to(tl.int64) * stride_hn + offs_r * stride_hr, total, mask=r_mask & last)
            tickets.hand_back(counter, ticket, SPLITS, BLOCK_R)

    @triton.jit
    def expand_block(h_row, b_rows, slot, o_mask, stride_hr, stride_br, R: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_R: tl.constexpr):
        """fp32 ``B[slot, o] @ h`` for a block of outputs ``o`` (``b_rows``: their rows of ``B[slot]``;
        ``h_row``: the row's shrunk vector), zeros for slot -1: the expand's sum, in its order
        (``BLOCK_R``: :func:`expand_block_r`). Kernels that read a projection's output take it
        themselves rather than reading it back after an expand of its own (a decode step's SiLU
        product, the kernel that turns its q/k heads; :class:`tinsmith.models.lora_bank.PendingExpand`)."""
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = (offs_r < R) & ((offs_r * 0 + slot) >= 0)
            b = tl.load(b_rows + offs_r[None, :] * stride_br, mask=o_mask[:, None] & r_mask[None, :],
                        other=0.0).to(tl.float32)
            h = tl.load(h_row + offs_r * stride_hr, mask=r_mask, other=0.0).to(tl.float32)
            acc += tl.sum(b * h[None, :], axis=1)
        return acc

    @triton.jit
    def _bgmv_expand_kernel(h_ptr, b_ptr, idx_ptr, hoff_ptr, y_ptr, O: tl.constexpr, R: tl.constexpr,
                            stride_hn, stride_hr, stride_bs, stride_bo, stride_br, stride_yn, stride_yo,
                            SEGMENTED: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                            PDL: tl.constexpr = False):
        """``y[row, o] += B[idx[row], o] @ h[row, hoff[o]:hoff[o] + R]`` for one row and block of
        outputs (``hoff[o]`` = 0 unless ``SEGMENTED``: packed projections); rows of slot -1 are
        left as they are. Packed parts' vectors are gathered per element: cheap L1 hits, and
        faster on an H200 than loading each part's vector whole and selecting per column."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        slot = tl.load(idx_ptr + row).to(tl.int64)
        # the slot compared per element, as in the shrink
        o_mask = (offs_o < O) & ((offs_o * 0 + slot) >= 0)
        b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + offs_o[:, None] * stride_bo
        h_row = h_ptr + row.to(tl.int64) * stride_hn
        if SEGMENTED:
            acc = tl.zeros([BLOCK_O], dtype=tl.float32)
            hoff = tl.load(hoff_ptr + offs_o, mask=offs_o < O, other=0).to(tl.int64)
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = (offs_r < R) & ((offs_r * 0 + slot) >= 0)
                mask2 = o_mask[:, None] & r_mask[None, :]
                b = tl.load(b_rows + offs_r[None, :] * stride_br, mask=mask2, other=0.0).to(tl.float32)
                h2 = tl.load(h_row + (hoff[:, None] + offs_r[None, :]) * stride_hr, mask=mask2,
                             other=0.0).to(tl.float32)
                acc += tl.sum(b * h2, axis=1)
        else:
            acc = expand_block(h_row, b_rows, slot, o_mask, stride_hr, stride_br, R, BLOCK_O, BLOCK_R)
        cols = y_ptr + row.to(tl.int64) * stride_yn + offs_o * stride_yo
        acc += tl.load(cols, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(cols, acc.to(y_ptr.dtype.element_ty), mask=o_mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def expand_block_r(R: int) -> int:
    """The expand's block of the rank (:func:`expand_block`'s ``BLOCK_R``): kernels adding an
    expand's sum themselves take the same, so they sum in its order."""
    return _pow2(R, 16, 64)


def _shrink_blocks(R: int, K: int, cpu: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the shrink (wide K blocks on a CPU: :data:`CPU_MAX_BLOCK`)."""
    return _pow2(R, 16, 64), _pow2(K, 16, CPU_MAX_BLOCK if cpu else 128)


def shrink_split(rows: int, R: int, K: int, cpu: bool = False) -> int:
    """How many programs share each row's (or the segmented shrink's tile's) reduction: enough for about :data:`SHRINK_PROGRAMS`
    programs in all, at most :data:`SHRINK_MAX_SPLIT` and one K block each (1 once the rows alone
    fill the GPU: then the partials' sum only costs). Shapes only, so a captured decode step keeps
    its grid. :data:`SHRINK_SPLIT` overrides it."""
    if SHRINK_SPLIT is not None:
        return max(1, SHRINK_SPLIT)
    block_r, block_k = _shrink_blocks(R, K, cpu)
    per_split = max(1, rows) * triton.cdiv(R, block_r)
    return max(1, min(triton.cdiv(SHRINK_PROGRAMS, per_split), SHRINK_MAX_SPLIT, triton.cdiv(K, block_k)))


def shrink_plan(n: int, K: int, R: int, cpu: bool, split: int | None) -> tuple[int, int, int, int]:
    """(splits, inputs a split, BLOCK_R, BLOCK_K) of a shrink over ``n`` rows (or the segmented
    shrink's tiles): ``split`` (None: :func:`shrink_split`) slices of whole K blocks, fewer when the
    blocks run out, none past the input."""
    block_r, block_k = _shrink_blocks(R, K, cpu)
    blocks = triton.cdiv(K, block_k)
    split = max(1, min(shrink_split(n, R, K, cpu) if split is None else split, blocks))
    k_split = triton.cdiv(blocks, split) * block_k
    return triton.cdiv(K, k_split), k_split, block_r, block_k


def _shrink_launch(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor, split: int | None,
                   summed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(partials (rows, splits, r) fp32, their sum (rows, r) when the kernel added them up, else
    None): ``summed`` asks for the sum in the kernel, which it does where there are counters for
    the rows and the reduction is split."""
    n, K = x.shape
    R = A_bank.shape[1]
    split, k_split, block_r, block_k = shrink_plan(n, K, R, x.device.type == "cpu", split)
    out = torch.empty(n, split, R, dtype=torch.float32, device=x.device)
    r_blocks = triton.cdiv(R, block_r)
    counters = tickets.counters(x.device) if summed and split > 1 and tickets.fits(n * r_blocks) else None
    h = None if counters is None else torch.empty(n, R, dtype=torch.float32, device=x.device)
    if n == 0:
        return out, h
    target = out[:, 0] if h is None else h
    _bgmv_shrink_kernel[(n, r_blocks, split)](
        x, A_bank, idx, out, target, out if counters is None else counters, R, K, k_split, split, x.stride(0),
        x.stride(1), A_bank.stride(0), A_bank.stride(1), A_bank.stride(2), out.stride(0), out.stride(1),
        out.stride(2), target.stride(0), target.stride(1), SUM=counters is not None, BLOCK_R=block_r,
        BLOCK_K=block_k, **pdl.options(x))
    return out, h


# Whether the shrink's last program adds its row's partials (one launch); False: torch adds them
# in a second one (benchmarks compare the two).
SUM_IN_KERNEL = True


def shrink_partials_triton(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor,
                           split: int | None = None) -> torch.Tensor:
    """The shrink's partial sums, (rows, splits, r) fp32: ``[:, s]`` reduces the ``s``-th slice of
    the input (``split`` slices of whole K blocks; fewer when the blocks run out). ``split`` None:
    :func:`shrink_split`; 1: one pass per row, as before split-K."""
    return _shrink_launch(x, A_bank, idx, split, summed=False)[0]


def shrink_triton(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """:func:`shrink_torch` as the split-K kernel (CUDA; interpreted for CPU tensors), its partials
    added up by the last program of each row (:data:`SUM_IN_KERNEL`) or by torch, in a fixed order."""
    partials, h = _shrink_launch(x, A_bank, idx, split, summed=SUM_IN_KERNEL)
    if h is not None:
        return h
    return partials[:, 0] if partials.shape[1] == 1 else partials.sum(1)


def expand_triton(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor,
                  h_offsets: torch.Tensor | None = None) -> None:
    """:func:`expand_torch` (with ``h_offsets``: :func:`expand_parts_torch`) as one BGMV kernel
    (CUDA; interpreted for CPU tensors)."""
    n, N = y.shape
    R = B_bank.shape[2]
    if n == 0:
        return
    cpu = y.device.type == "cpu"
    block_r = expand_block_r(R)
    block_n = _pow2(N, 16, CPU_MAX_BLOCK if cpu else EXPAND_BLOCK)
    _bgmv_expand_kernel[(n, triton.cdiv(N, block_n))](
        h, B_bank, idx, idx if h_offsets is None else h_offsets, y, N, R, h.stride(0), h.stride(1),
        B_bank.stride(0), B_bank.stride(1), B_bank.stride(2), y.stride(0), y.stride(1),
        SEGMENTED=h_offsets is not None, BLOCK_O=block_n, BLOCK_R=block_r, **pdl.options(y))


# ----------------------------------------------------------------------------- dispatch
def shrink(x: torch.Tensor, A_bank: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(rows, r) fp32: each row's ``x`` through its slot's A (zeros for slot -1). Triton where usable."""
    if triton_usable(x):
        out = GUARD.call(shrink_triton, x, A_bank, idx, on=x)
        if out is not None:
            return out
    return shrink_torch(x, A_bank, idx)


def expand(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor) -> None:
    """Add each row's ``B_bank[slot] @ h`` into ``y`` in place (nothing for slot -1). Triton where usable."""
    if not (triton_usable(y) and GUARD.ran(expand_triton, y, h, B_bank, idx, on=y)):
        expand_torch(y, h, B_bank, idx)


def expand_parts(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, idx: torch.Tensor,
                 columns: list[tuple[int, int]], h_offsets: torch.Tensor) -> None:
    """:func:`expand` for packed projections: columns ``[a, b)`` of part ``j`` read part ``j`` of
    ``h`` (``h_offsets`` says so per column, for the kernel). One launch where Triton is usable."""
    if not (triton_usable(y) and GUARD.ran(expand_triton, y, h, B_bank, idx, h_offsets, on=y)):
        expand_parts_torch(y, h, B_bank, idx, columns)

