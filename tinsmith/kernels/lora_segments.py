"""Segmented LoRA ops: the rows of a decode batch that share an adapter read it once (SGMV).

The gathered kernels (:mod:`tinsmith.kernels.lora_gather`, BGMV) give every row its own
programs, each reading that row's adapter: 64 rows of 8 adapters read each adapter's factors 8
times over, from L2 at best. On an H200 those kernels took 2.8 ms of a 5.0 ms decode step at 64
rows and 8 adapters, which is why such a batch kept 0.63x of the base model's speed
(docs/performance.md). Here the rows are sorted by adapter once per batch (:func:`row_tiles`, on
the host, when the batch's rows change) and cut into tiles of at most ``BLOCK_M`` rows of one
adapter; each program takes one tile and multiplies it with its adapter's factors as a small
matrix product (``tl.dot``), so an adapter is read once per tile instead of once per row. This
is the SGMV scheme of Punica and S-LoRA.

- ``shrink(x, A_bank, tiles) -> h``: ``h[i] = A_bank[idx[i]] @ x[i]``, (rows, r) fp32, zeros for
  rows of no adapter (their tiles have slot -1), split over the input as the gathered shrink is
  (fp32 partials added up in split order by the last program of a tile, which the gathered
  shrink's tickets tell: replays repeat bit for bit);
- ``expand(y, h, B_bank, tiles, h_offsets=None)``: ``y[i] += B_bank[idx[i]] @ h[i]`` in place,
  rows of no adapter untouched; with ``h_offsets``, packed projections (q/k/v) each reading their
  own part of ``h``, which needs every part's width to be a multiple of the output block
  (:func:`expand_block`; else the gathered kernel runs).

Shapes depend only on the row count and the tile count, and nothing reads back to the host, so
a CUDA graph can hold them (the tile tables are inputs it reads). Products are exact and summed
in fp32, as in the gathered kernels: the shrink multiplies fp16 inputs as they are, bf16 ones
widened to fp32 in tf32 (whose mantissa holds bf16's), fp32 ones in full precision (``ieee``); the
expand multiplies fp32 ``h`` by the factors widened to fp32 (``ieee``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tinsmith.kernels import lora_gather, pdl, tickets
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import CPU_MAX_BLOCK, triton
from tinsmith.transfers import to_device

tl = None
if triton is not None:
    import triton.language as tl

# Rows per tile: tl.dot's smallest block. A tile holds rows of one adapter only.
BLOCK_M = 16
# Whether decode batches over adapter banks take these kernels where Triton runs (else the gathered
# ones). Off until a GPU run has timed both in one process (bench/gpu's ``lora_gather`` item).
ENABLED = False
GUARD = KernelGuard("segmented LoRA kernels", "gathering each row's adapter")


def wanted(device: torch.device) -> bool:
    """Whether rows on ``device`` are cut into tiles for these kernels: enabled, Triton present and
    running there (the gathered kernels' switch), and no failure of these kernels here."""
    backend = lora_gather.BACKEND
    return (ENABLED and triton is not None and GUARD.failed is None and lora_gather.GUARD.failed is None
            and (backend == "triton" or (backend == "auto" and torch.device(device).type == "cuda")))


@dataclass(frozen=True)
class RowTiles:
    """A batch's rows grouped by bank position for the segmented kernels (device tensors, int32):
    ``order`` the row indices sorted by position (rows of no adapter together), then per tile its
    position (``slot``; -1: rows of no adapter), its first entry of ``order`` (``first``) and its
    row count (``count``; 0: an unused tile of a padded table)."""

    order: torch.Tensor
    slot: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor

    @property
    def tiles(self) -> int:
        return self.slot.shape[0]


def tile_table(positions: Sequence[int], block: int = BLOCK_M, tiles: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The host side of :func:`row_tiles`: (order, slot, first, count) as int32 arrays, padded with
    unused tiles to ``tiles`` (at least the tiles the rows need)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    order = np.argsort(pos, kind="stable")
    slots, starts, counts = np.unique(pos[order], return_index=True, return_counts=True)
    slot, first, count = [], [], []
    for s, a, c in zip(slots.tolist(), starts.tolist(), counts.tolist()):
        for m in range(0, c, block):
            slot.append(s)
            first.append(a + m)
            count.append(min(block, c - m))
    need = len(slot)
    total = need if tiles is None else tiles
    if total < need:
        raise ValueError(f"{need} tiles needed, {total} allowed")
    pad = total - need
    return (order.astype(np.int32), np.array(slot + [-1] * pad, dtype=np.int32),
            np.array(first + [0] * pad, dtype=np.int32), np.array(count + [0] * pad, dtype=np.int32))


def tiles_needed(positions: Sequence[int], block: int = BLOCK_M) -> int:
    """How many tiles :func:`tile_table` cuts these rows into."""
    _, counts = np.unique(np.asarray(positions, dtype=np.int64), return_counts=True)
    return int(sum(-(-c // block) for c in counts.tolist()))


def row_tiles(positions: Sequence[int], device: torch.device, block: int = BLOCK_M,
              tiles: int | None = None) -> RowTiles:
    """Tiles of the rows whose bank positions are ``positions`` (-1: no adapter), on ``device``
    in one copy."""
    return tables_on(tile_table(positions, block, tiles), device)


def tables_on(table: tuple[np.ndarray, ...], device: torch.device) -> RowTiles:
    """:func:`tile_table`'s arrays as a :class:`RowTiles` on ``device``, in one copy."""
    order, slot, first, count = table
    flat = to_device(np.concatenate([order, slot, first, count]), device, torch.int32)
    n, t = order.shape[0], slot.shape[0]
    return RowTiles(flat[:n], flat[n:n + t], flat[n + t:n + 2 * t], flat[n + 2 * t:])


# ----------------------------------------------------------------------------- Triton (SGMV)
if triton is not None:

    @triton.jit
    def _sgmv_shrink_kernel(x_ptr, a_ptr, order_ptr, slot_ptr, first_ptr, count_ptr, out_ptr, h_ptr, ticket_ptr,
                            R: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                            stride_xn, stride_xk, stride_as, stride_ar, stride_ak, stride_on, stride_os, stride_or,
                            stride_hn, stride_hr, SUM: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr = False):
        """``out[row, s, o] = sum over k in split s of x[row, k] * A[slot, o, k]`` for the rows of
        one tile, block of ``BLOCK_R`` outputs and split ``s``; zeros for a tile of slot -1. With
        ``SUM``, the tile and block's last program to finish also writes ``h[row, o]``, the
        partials added in split order (as the gathered shrink's tickets)."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        t = tl.program_id(0)
        split = tl.program_id(2)
        count = tl.load(count_ptr + t)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(order_ptr + tl.load(first_ptr + t) + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        live = (offs_m * 0 + slot) >= 0  # per element, as in the gathered kernels
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            offs_k = split * K_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xn + offs_k[None, :] * stride_xk,
                         mask=(m_mask & live)[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptr + tl.maximum(slot, 0) * stride_as + offs_r[None, :] * stride_ar
                         + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & r_mask[None, :] & ((offs_k * 0 + slot) >= 0)[:, None], other=0.0)
            if WIDEN:  # bf16 widened to fp32 fits tf32's mantissa: the tensor cores' product is exact
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc += tl.dot(xt, at, input_precision=PRECISION)
        partials = out_ptr + rows[:, None] * stride_on + offs_r[None, :] * stride_or
        mask = m_mask[:, None] & r_mask[None, :]
        tl.store(partials + split * stride_os, acc, mask=mask)
        if SUM:
            counter = ticket_ptr + t * tl.num_programs(1) + tl.program_id(1)
            ticket = tickets.take(counter)
            mask = mask & ((offs_r[None, :] * 0 + ticket) == SPLITS - 1)
            total = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for s in range(SPLITS):  # split order, whichever program came last
                total += tl.load(partials + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(h_ptr + rows[:, None] * stride_hn + offs_r[None, :] * stride_hr, total, mask=mask)
            tickets.hand_back(counter, ticket, SPLITS, BLOCK_R)

    @triton.jit
    def _sgmv_expand_kernel(h_ptr, b_ptr, order_ptr, slot_ptr, first_ptr, count_ptr, hoff_ptr, y_ptr,
                            O: tl.constexpr, R: tl.constexpr, stride_hn, stride_hr, stride_bs, stride_bo, stride_br,
                            stride_yn, stride_yo, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
        """``y[row, o] += B[slot, o] @ h[row, hoff:hoff + R]`` for the rows of one tile and block of
        outputs (``hoff`` the block's part's offset when ``SEGMENTED``, else 0); a tile of slot -1
        (or an unused one) changes nothing."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        t = tl.program_id(0)
        count = tl.load(count_ptr + t)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = (offs_m < count) & ((offs_m * 0 + slot) >= 0)
        rows = tl.load(order_ptr + tl.load(first_ptr + t) + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = offs_o < O
        hoff = 0
        if SEGMENTED:
            hoff = tl.load(hoff_ptr + tl.program_id(1) * BLOCK_O).to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < R
            ht = tl.load(h_ptr + rows[:, None] * stride_hn + (hoff + offs_r[None, :]) * stride_hr,
                         mask=m_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
            bt = tl.load(b_ptr + tl.maximum(slot, 0) * stride_bs + offs_o[None, :] * stride_bo
                         + offs_r[:, None] * stride_br,
                         mask=r_mask[:, None] & o_mask[None, :] & ((offs_r * 0 + slot) >= 0)[:, None],
                         other=0.0).to(tl.float32)
            acc += tl.dot(ht, bt, input_precision="ieee")
        cols = y_ptr + rows[:, None] * stride_yn + offs_o[None, :] * stride_yo
        mask = m_mask[:, None] & o_mask[None, :]
        acc += tl.load(cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _shrink_launch(x: torch.Tensor, A_bank: torch.Tensor, tiles: RowTiles, split: int | None,
                   summed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(partials (rows, splits, r) fp32, their sum (rows, r) when the kernel added them up, else
    None), as the gathered shrink's (:func:`tinsmith.kernels.lora_gather._shrink_launch`)."""
    n, K = x.shape
    R = A_bank.shape[1]
    # The gathered shrink's blocks and split, with a tile's programs where it has a row's.
    split, k_split, block_r, block_k = lora_gather.shrink_plan(tiles.tiles, K, R, x.device.type == "cpu", split)
    out = torch.empty(n, split, R, dtype=torch.float32, device=x.device)
    r_blocks = triton.cdiv(R, block_r)
    fits = summed and split > 1 and tickets.fits(tiles.tiles * r_blocks)
    h = torch.empty(n, R, dtype=torch.float32, device=x.device) if fits else None  # every row is in a tile
    if n == 0 or tiles.tiles == 0:
        return out.zero_(), None if h is None else h.zero_()
    target = out[:, 0] if h is None else h
    widen = x.dtype == torch.bfloat16
    _sgmv_shrink_kernel[(tiles.tiles, r_blocks, split)](
        x, A_bank, tiles.order, tiles.slot, tiles.first, tiles.count, out, target,
        tickets.counters(x.device) if fits else out, R, K, k_split, split,
        x.stride(0), x.stride(1), A_bank.stride(0), A_bank.stride(1), A_bank.stride(2),
        out.stride(0), out.stride(1), out.stride(2), target.stride(0), target.stride(1), SUM=fits,
        WIDEN=widen, PRECISION="tf32" if widen else "ieee", BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
        **pdl.options(x))
    return out, h


def shrink_partials_triton(x: torch.Tensor, A_bank: torch.Tensor, tiles: RowTiles,
                           split: int | None = None) -> torch.Tensor:
    """The segmented shrink's partial sums, (rows, splits, r) fp32 (see the gathered shrink's)."""
    return _shrink_launch(x, A_bank, tiles, split, summed=False)[0]


def shrink(x: torch.Tensor, A_bank: torch.Tensor, tiles: RowTiles, split: int | None = None) -> torch.Tensor:
    """(rows, r) fp32: each row's ``x`` through its tile's adapter (zeros for rows of none), the
    partials added up in split order by the kernel's last program (or by torch, as
    :data:`tinsmith.kernels.lora_gather.SUM_IN_KERNEL` says)."""
    partials, h = _shrink_launch(x, A_bank, tiles, split, summed=lora_gather.SUM_IN_KERNEL)
    if h is not None:
        return h
    return partials[:, 0] if partials.shape[1] == 1 else partials.sum(1)


def expand_block(N: int, columns: Sequence[tuple[int, int]] | None, cpu: bool = False) -> int | None:
    """The expand's output block: as wide as the outputs allow (at most 128, on a CPU
    ``CPU_MAX_BLOCK``), and for packed projections dividing every part's bounds, so that each
    block reads one part of ``h``. None when the parts' bounds are not multiples of 16."""
    hi = CPU_MAX_BLOCK if cpu else 128
    block = _pow2(N, 16, hi)
    if columns is None or len(columns) <= 1:
        return block
    while block >= 16 and any(a % block or b % block for a, b in columns[:-1]):
        block //= 2
    if block < 16 or columns[-1][0] % block:
        return None
    return block


def expand(y: torch.Tensor, h: torch.Tensor, B_bank: torch.Tensor, tiles: RowTiles,
           h_offsets: torch.Tensor | None = None, block: int | None = None) -> None:
    """Add each row's ``B_bank[slot] @ h`` (its part's, with ``h_offsets``) into ``y`` in place.
    ``block``: the output block (:func:`expand_block`, which packed projections need)."""
    n, N = y.shape
    if n == 0 or tiles.tiles == 0:
        return
    R = B_bank.shape[2]
    block_o = block or expand_block(N, None, y.device.type == "cpu")
    _sgmv_expand_kernel[(tiles.tiles, triton.cdiv(N, block_o))](
        h, B_bank, tiles.order, tiles.slot, tiles.first, tiles.count,
        tiles.order if h_offsets is None else h_offsets, y, N, R,
        h.stride(0), h.stride(1), B_bank.stride(0), B_bank.stride(1), B_bank.stride(2), y.stride(0), y.stride(1),
        SEGMENTED=h_offsets is not None, BLOCK_M=BLOCK_M, BLOCK_O=block_o, BLOCK_R=_pow2(R, 16, 64), **pdl.options(y))
