"""Many 2-D blocks copied into strided views, cast and scaled, in one launch.

A q/k/v or gate/up group's several-tenant ``B`` stack is block-diagonal: each tenant's block of
it is a strided view (rows a whole stack row apart), and after every optimizer step each block is
rewritten from the tenant's fp32 master and multiplied by the adapter's scale
(:mod:`tinsmith.models.copy_refresh`). torch's multi-tensor copy and multiply take a strided tensor
one kernel at a time: two launches a block, 140 blocks a tenant on a 28-layer model, which on an
H200's host is a few milliseconds a tenant and step while the device waits. :class:`BlockCopies`
does every block of a list in one launch: one program per (block, tile of its rows), the blocks'
addresses, sizes and strides read from a small table made once for the list.

The arithmetic is torch's: each element rounded to the destination's dtype (as ``copy_`` rounds,
to nearest even), then, for a scaled block, multiplied by the scale in fp32 and rounded again (as
a multiply in place of a half-precision tensor rounds). CUDA tensors take the kernel; the CPU (and
any list the kernel cannot take) the torch calls, which are the reference in tests.
"""

from __future__ import annotations

import torch

from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')
from tinsmith.transfers import to_device

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors, torch for the rest; "torch"; "triton": the kernel for every
# tensor (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("block copy kernel", "copying blocks in torch")
TILE = 4096  # elements a program copies (a tile of rows of its block)


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype)


def usable(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """Whether :class:`BlockCopies` of these pairs takes the kernel: one device, one dtype on each
    side (fp32, bf16 or fp16), 2-D tensors of one shape per pair with unit stride along a row."""
    return bool(dst) and _allowed(dst[0]) and _fits(dst, src)


def _allowed(on: torch.Tensor) -> bool:
    return triton is not None and GUARD.allows(BACKEND, on)


def _fits(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """The pairs' part of :func:`usable` (what stays true of a list whose tensors stay where they are)."""
    if triton is None:
        return False
    d0, s0 = dst[0], src[0]
    if _tl_dtype(d0.dtype) is None or _tl_dtype(s0.dtype) is None:
        return False
    return all(d.device == d0.device and s.device == d0.device and d.dtype == d0.dtype and s.dtype == s0.dtype
               and d.dim() == 2 and d.shape == s.shape and d.stride(1) == 1 and s.stride(1) == 1
               for d, s in zip(dst, src))


class BlockCopies:
    """``dst[i].copy_(src[i])`` then ``dst[i].mul_(scales[i])`` (None: no multiply) for a list of
    pairs whose tensors stay where they are across many calls (the table of their addresses is
    made at the first kernel run and kept: the pairs' tensors are held here so that it stays valid)."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor], scales: list[float | None]):
        self.dst, self.src, self.scales = dst, src, scales
        self._table: tuple | None = None
        self._fits: bool | None = None  # whether the kernel takes these pairs (checked once: a step's host time)

    def __len__(self) -> int:
        return len(self.dst)

    def run(self) -> None:
        """Do every pair's copy (and multiply): one launch on a GPU, the torch calls elsewhere."""
        if not self.dst:
            return
        if _allowed(self.dst[0]):
            if self._fits is None:
                self._fits = _fits(self.dst, self.src)
            if self._fits and GUARD.ran(_launch, self, on=self.dst[0]):
                return
        torch_copies(self.dst, self.src, self.scales)


def torch_copies(dst: list[torch.Tensor], src: list[torch.Tensor], scales: list[float | None]) -> None:
    """What :class:`BlockCopies` does, in torch: one multi-tensor copy, then one multiply per scale."""
    torch._foreach_copy_(dst, src)
    by_scale: dict[float, list[torch.Tensor]] = {}
    for d, scale in zip(dst, scales):
        if scale is not None:
            by_scale.setdefault(float(scale), []).append(d)
    for scale, parts in by_scale.items():
        torch._foreach_mul_(parts, scale)


def _table(copies: BlockCopies) -> tuple:
    """(the blocks' int64 table and fp32 scales on the device, the most rows, the widest row). A
    block's row of the table: source address, destination address, rows, columns, the source's row
    stride, the destination's (in elements)."""
    device = copies.dst[0].device
    rows = [[s.data_ptr(), d.data_ptr(), d.shape[0], d.shape[1], s.stride(0), d.stride(0)]
            for d, s in zip(copies.dst, copies.src)]
    table = to_device(rows, device, torch.int64)  # no wait for the step's queued work
    scales = to_device([1.0 if x is None else float(x) for x in copies.scales], device, torch.float32)
    return table, scales, max(d.shape[0] for d in copies.dst), max(d.shape[1] for d in copies.dst)


def _launch(copies: BlockCopies) -> None:
    if copies._table is None:
        copies._table = _table(copies)
    table, scales, most_rows, widest = copies._table
    block_c = triton.next_power_of_2(max(1, widest))
    block_r = max(1, min(triton.next_power_of_2(max(1, most_rows)), TILE // block_c))
    grid = (len(copies), triton.cdiv(most_rows, block_r))
    _block_copy_kernel[grid](table, scales, SRC=_tl_dtype(copies.src[0].dtype), DST=_tl_dtype(copies.dst[0].dtype),
                             SCALED=any(x is not None for x in copies.scales), BLOCK_R=block_r, BLOCK_C=block_c)


if triton is not None:

    @triton.jit
    def _block_copy_kernel(table_ptr, scale_ptr, SRC: tl.constexpr, DST: tl.constexpr, SCALED: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Block ``pid0``'s rows ``pid1 * BLOCK_R ...``: read, rounded to the destination's dtype,
        scaled (rounded again), written through the destination's row stride."""
        block = tl.program_id(0).to(tl.int64)
        at = table_ptr + block * 6
        rows = tl.load(at + 2)
        r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        if tl.program_id(1).to(tl.int64) * BLOCK_R < rows:
            src = tl.load(at).to(tl.pointer_type(SRC))
            dst = tl.load(at + 1).to(tl.pointer_type(DST))
            cols = tl.load(at + 3)
            c = tl.arange(0, BLOCK_C).to(tl.int64)
            mask = (r < rows)[:, None] & (c < cols)[None, :]
            x = tl.load(src + r[:, None] * tl.load(at + 4) + c[None, :], mask=mask).to(DST)
            if SCALED:
                x = (x.to(tl.float32) * tl.load(scale_ptr + block)).to(DST)
            tl.store(dst + r[:, None] * tl.load(at + 5) + c[None, :], x, mask=mask)
