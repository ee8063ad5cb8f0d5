"""A decode step's per-row bookkeeping in one kernel: positions, K/V slots and key counts.

Before its layers run, a decode step works out per row, from the cache's lengths and the rows'
live marks: the position the row decodes at (for rotary, plus the row's rope offset), the page
and offset its new key and value go to in a paged cache (padding rows: the scratch page), and how
many keys its attention reads. In torch that is ten elementwise kernels over a few hundred bytes
(a product, a cast, an ``arange``, a floor division, the page table's gather and its cast, a
``where``, a remainder, an add, the positions' ``addcmul``): on a GPU each is a launch and a tail,
together about 1.5% of a 64-row step replayed from a CUDA graph (~5 us a kernel). :func:`compute` writes them all
in one launch of one program per block of rows.

The values are integers: the kernel's and torch's agree exactly (tests compare them). Inference
only, CUDA tensors (or, in tests, Triton's interpreter); the torch ops stay the CPU path and the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinsmith.kernels import pdl
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors, torch for the rest; "torch"; "triton": the kernel for every
# tensor (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("decode step's row bookkeeping kernel", "working out positions and slots in torch")
ROWS_BLOCK = 256  # rows a program takes: the largest decode bucket in one program


@dataclass
class RowsOfStep:
    """What :func:`compute` wrote for rows ``[0, n)``, each (n,) int64."""

    pos: torch.Tensor  # the position each row decodes at (its length; 0 for a padding row)
    seen: torch.Tensor  # the keys its attention reads: ``pos + 1``
    positions: torch.Tensor | None  # ``pos + rope`` where a rope offset was given
    page: torch.Tensor | None  # the page its new key and value go to, in a paged cache
    at: torch.Tensor | None  # their offset in that page


def usable(lengths: torch.Tensor) -> bool:
    """Whether :func:`compute` takes the kernel for a cache whose lengths are ``lengths``."""
    return triton is not None and GUARD.allows(BACKEND, lengths) and lengths.dtype == torch.long


def compute(lengths: torch.Tensor, n: int, live: torch.Tensor | None = None, rope: torch.Tensor | None = None,
            table: torch.Tensor | None = None, page_size: int = 1, scratch: int = 0) -> RowsOfStep | None:
    """Rows ``[0, n)``'s bookkeeping for one decode step, as the torch ops give it:

    - ``pos = lengths[:n] * live`` (``lengths[:n]`` without ``live``, a (n,) 0/1 int64 mark);
    - ``seen = pos + 1``; ``positions = pos + rope`` where ``rope`` (n,) int64 is given;
    - with a page ``table`` (rows, pages per row) int32: ``page = table[r, pos // page_size]``
      (``scratch`` for a row whose ``live`` is 0) and ``at = pos % page_size``.

    None when the kernel failed here (the caller takes the torch ops)."""
    device = lengths.device
    if lengths.shape[0] < n or (table is not None and table.shape[0] < n):
        raise ValueError(f"{n} rows asked of lengths for {lengths.shape[0]} and a page table of "
                         f"{None if table is None else table.shape[0]}")  # the kernel would read past them

    def empty() -> torch.Tensor:
        return torch.empty(n, dtype=torch.long, device=device)

    out = RowsOfStep(empty(), empty(), None if rope is None else empty(), *((None, None) if table is None
                                                                            else (empty(), empty())))
    if n == 0:
        return out
    done = GUARD.call(_launch, lengths, live, rope, table, page_size, scratch, out, on=lengths)
    return None if done is None else out


def _launch(lengths, live, rope, table, page_size: int, scratch: int, out: RowsOfStep) -> bool:
    n = out.pos.shape[0]
    dummy = out.pos  # never read: the constexpr switches leave it alone
    block = min(ROWS_BLOCK, triton.next_power_of_2(n))
    _rows_kernel[(triton.cdiv(n, block),)](
        lengths, dummy if live is None else live, dummy if rope is None else rope,
        dummy if table is None else table, out.pos, out.seen,
        dummy if out.positions is None else out.positions, dummy if out.page is None else out.page,
        dummy if out.at is None else out.at, n, 0 if table is None else table.stride(0), page_size, scratch,
        LIVE=live is not None, ROPE=rope is not None, PAGED=table is not None, BLOCK=block, num_warps=1,
        **pdl.options(lengths))
    return True


if triton is not None:

    @triton.jit
    def _rows_kernel(lengths_ptr, live_ptr, rope_ptr, table_ptr, pos_ptr, seen_ptr, positions_ptr, page_ptr, at_ptr,
                     n, stride_table, page_size, scratch, LIVE: tl.constexpr, ROPE: tl.constexpr,
                     PAGED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Rows ``[pid * BLOCK, (pid + 1) * BLOCK)``: every output of :func:`compute`."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < n
        pos = tl.load(lengths_ptr + rows, mask=mask, other=0)
        if LIVE:
            live = tl.load(live_ptr + rows, mask=mask, other=0)
            pos = pos * live
        tl.store(pos_ptr + rows, pos, mask=mask)
        tl.store(seen_ptr + rows, pos + 1, mask=mask)
        if ROPE:
            tl.store(positions_ptr + rows, pos + tl.load(rope_ptr + rows, mask=mask, other=0), mask=mask)
        if PAGED:
            page = tl.load(table_ptr + rows.to(tl.int64) * stride_table + pos // page_size, mask=mask, other=0)
            page = page.to(tl.int64)
            if LIVE:
                page = tl.where(live != 0, page, scratch)
            tl.store(page_ptr + rows, page, mask=mask)
            tl.store(at_ptr + rows, pos % page_size, mask=mask)


__all__ = ["BACKEND", "RowsOfStep", "compute", "usable"]
