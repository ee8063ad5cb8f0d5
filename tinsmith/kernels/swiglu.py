"""``silu(gate) * up`` as one kernel when sampling on a GPU.

The MLP of every dense family computes ``F.silu(gate) * up`` over the halves of its packed
gate/up output: two kernels a layer in torch (the SiLU into a new tensor, the product in place),
each at decode sizes mostly launch and tail. :func:`silu_mul` does the same arithmetic in one,
with torch's roundings: the SiLU in fp32 (``g / (1 + exp(-g))``) rounded to the input dtype, then
the product rounded once.

Inference only (no autograd): training keeps the torch path.
"""

from __future__ import annotations

import torch

from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors outside autograd, torch for the rest; "torch"; "triton": the
# kernel wherever no gradient is needed (CPU tensors need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("SiLU-and-multiply kernel", "multiplying in torch")
BLOCK = 1024  # columns a program takes


def usable(y: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` takes the kernel for ``y`` (rows, 2 x width): outside autograd, its
    rows at one stride with unit stride along them, and not once the kernel failed here."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None:
        return False
    if (BACKEND == "auto" and not y.is_cuda) or torch.is_grad_enabled():
        return False
    return y.dim() == 2 and y.shape[1] % 2 == 0 and y.stride(-1) == 1 and y.dtype.is_floating_point


def silu_mul(y: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(y[:, :i]) * y[:, i:]`` with ``i`` half of ``y``'s columns, as a new contiguous
    (rows, i) tensor; None when the kernel failed here (the caller takes the torch path)."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, width, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    return GUARD.call(_launch, y, out, on=y)


def _launch(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    rows, width = out.shape
    block = min(BLOCK, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](y, out, width, y.stride(0), BLOCK=block,
                                                        num_warps=4 if block >= 512 else 1)
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(y_ptr, out_ptr, width, stride_row, BLOCK: tl.constexpr):
        """Columns ``[pid1 * BLOCK, ...)`` of one row: the gate half's SiLU, rounded to the
        dtype, times the up half, rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        dtype = out_ptr.dtype.element_ty
        g = tl.load(y_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + row * stride_row + width + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (act * u).to(dtype), mask=mask)
