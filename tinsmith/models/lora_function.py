"""One LoRA projection in training as a single autograd node with a hand-written backward.

``y = x W^T (+ b) + scale * (x A^T) B^T`` written with torch's ops leaves autograd a node per
op: the adapter's casts to the compute dtype, two linears, an ``addmm``, and in the backward
the ``addmm``'s two products each followed by a separate multiply by ``scale``, and an add of
the input gradient's base and adapter parts. On a GPU a LoRA step of a small model is bound by
the host's launches as much as by the device (docs/performance.md), and these small kernels
are most of what a LoRA projection launches besides its GEMMs. Here the backward is five GEMMs
and nothing else: ``scale`` rides in the GEMMs' epilogues (``alpha``) and the input gradient's
two parts are summed by the second GEMM (``addmm_``), which also rounds once instead of three
times in bf16.

The adapter's weights stay fp32 masters; in a bf16 model the forward reads their bf16 copies
(:func:`compute_copies`, made once per optimizer step rather than once per forward) and
autograd casts the bf16 gradients back to the masters' dtype, as it did for the casts' nodes.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


class LoraLinearFunction(torch.autograd.Function):
    """``y = x W^T (+ b) + scale * (x A^T) B^T`` for 2-D ``x`` (rows, in); ``W`` and ``b`` frozen.

    ``A_c``/``B_c`` are the adapter's weights in ``x``'s dtype (the masters themselves when the
    dtypes agree); the gradients go to the masters ``A``/``B``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                B: torch.Tensor, A_c: torch.Tensor, B_c: torch.Tensor, scale: float) -> torch.Tensor:
        h = F.linear(x, A_c)
        y = F.linear(x, weight, bias)
        y.addmm_(h, B_c.t(), alpha=scale)
        ctx.save_for_backward(x, weight, h, A_c, B_c)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, h, A_c, B_c = ctx.saved_tensors
        s = ctx.scale
        need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
        # d(loss)/dh = scale * g B; ``h`` only lends its shape (beta=0: its values are not read).
        gh = torch.addmm(h, g, B_c, beta=0, alpha=s)
        dx = dA = dB = None
        if need_x:
            dx = torch.mm(g, weight)
            dx.addmm_(gh, A_c)
        if need_a:
            dA = torch.mm(gh.t(), x)
        if need_b:
            dB = torch.addmm(B_c, g.t(), h, beta=0, alpha=s)
        return dx, None, None, dA, dB, None, None, None


def compute_copies(w, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter ``w``'s (A, B) in ``dtype``, detached: the masters themselves when they are
    already ``dtype``, else copies kept on ``w`` until an in-place update of a master (an
    optimizer step, a loaded state) changes its version counter."""
    A, B = w.A, w.B
    if A.dtype == dtype and B.dtype == dtype:
        return A.detach(), B.detach()
    key = (dtype, A._version, B._version, A.data_ptr(), B.data_ptr())
    cached = w.copies
    if cached is None or cached[0] != key:
        cached = w.copies = (key, A.detach().to(dtype), B.detach().to(dtype))
    return cached[1], cached[2]


def refresh_copies(weights: list, dtype: torch.dtype) -> None:
    """Bring every stale compute copy of ``weights`` (LoraWeights) up to date at once: one
    multi-tensor copy (a handful of launches on a GPU) instead of a cast per tensor at each
    layer's forward."""
    stale = []
    for w in weights:
        A, B = w.A, w.B
        if A.dtype == dtype and B.dtype == dtype:
            continue
        key = (dtype, A._version, B._version, A.data_ptr(), B.data_ptr())
        if w.copies is None or w.copies[0] != key:
            stale.append((w, key))
    if not stale:
        return
    dst, src = [], []
    for w, key in stale:  # new tensors: an older copy may still be saved for a pending backward
        a, b = torch.empty_like(w.A, dtype=dtype), torch.empty_like(w.B, dtype=dtype)
        w.copies = (key, a, b)
        dst += [a, b]
        src += [w.A.detach(), w.B.detach()]
    torch._foreach_copy_(dst, src)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w) -> torch.Tensor:
    """``x W^T (+ b) + scale (x A^T) B^T`` through :class:`LoraLinearFunction` (2-D ``x``)."""
    A_c, B_c = compute_copies(w, x.dtype)
    return LoraLinearFunction.apply(x, weight, bias, w.A, w.B, A_c, B_c, w.scale)
