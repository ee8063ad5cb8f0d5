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
(:func:`compute_copies`, made once per optimizer step rather than once per forward). Their
gradients come out of the GEMMs in fp32 where the device's GEMMs write fp32 (:func:`fp32_out_gemms`),
else in bf16 and autograd casts them to the masters' dtype, as it did for the casts' nodes.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinsmith.models.copy_refresh import copy_key, group_key, refresh_copies

# False: a trained projection runs as torch's ops, each its own autograd node (as before these
# nodes existed): bench/gpu times a step both ways in one run.
FUSED_NODES = True

_FP32_OUT: dict[torch.device, bool] = {}


def fp32_out_gemms(device: torch.device) -> bool:
    """Whether half-precision GEMMs on ``device`` write fp32 results themselves (``out_dtype``:
    CUDA in recent torch), checked once per device by one small product against its fp32 value.
    Where they do, the adapter's gradients come out of their GEMMs in the masters' fp32, with no
    rounding to bf16 and no cast kernel after."""
    if device.type == "cuda" and device.index is None:  # one entry per GPU, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    known = _FP32_OUT.get(device)
    if known is None:
        known = False
        if device.type == "cuda":
            try:
                a = torch.randn(16, 32, device=device).to(torch.bfloat16)
                b = torch.randn(32, 8, device=device).to(torch.bfloat16)
                want = a.float() @ b.float()
                got = torch.mm(a, b, out_dtype=torch.float32)
                scaled = torch.addmm(torch.empty_like(want), a, b, out_dtype=torch.float32, beta=0, alpha=0.5)
                known = (got.dtype == scaled.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-3, atol=1e-3)
                         and torch.allclose(scaled, 0.5 * want, rtol=1e-3, atol=1e-3))
            except (RuntimeError, TypeError):
                known = False
        _FP32_OUT[device] = known
    return known


def grad_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``alpha * a @ b`` as the gradient of a master of ``dtype``: in ``dtype`` straight from the
    GEMM where :func:`fp32_out_gemms` allows, else in ``a``'s dtype (autograd then casts it)."""
    if dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16) and fp32_out_gemms(a.device):
        if alpha == 1.0:
            return torch.mm(a, b, out_dtype=torch.float32)
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        return torch.addmm(out, a, b, out_dtype=torch.float32, beta=0, alpha=alpha)
    if alpha == 1.0:
        return torch.mm(a, b)
    return torch.addmm(torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device), a, b, beta=0, alpha=alpha)


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
        ctx.scale, ctx.master_dtype = scale, A.dtype
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
            dA = grad_mm(gh.t(), x, 1.0, ctx.master_dtype)
        if need_b:
            dB = grad_mm(g.t(), h, s, ctx.master_dtype)
        return dx, None, None, dA, dB, None, None, None


def compute_copies(w, dtype: torch.dtype, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter ``w``'s (A, B) in ``dtype``, detached: the masters themselves when they are
    already ``dtype``, else copies kept on ``w`` until an in-place update of a master (an
    optimizer step, a loaded state) changes its version counter. ``keep=False`` uses kept copies
    that are current but makes none to keep (an adapter only sampled from keeps no second copy:
    its casts last one forward, as before)."""
    A, B = w.A, w.B
    if A.dtype == dtype and B.dtype == dtype:
        return A.detach(), B.detach()
    key = copy_key(w, dtype)
    cached = w.copies
    if cached is None or cached[0] != key:
        if not keep:
            return A.detach().to(dtype), B.detach().to(dtype)
        cached = w.copies = (key, A.detach().to(dtype), B.detach().to(dtype))
    return cached[1], cached[2]


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w) -> torch.Tensor:
    """``x W^T (+ b) + scale (x A^T) B^T`` through :class:`LoraLinearFunction` (2-D ``x``)."""
    A_c, B_c = compute_copies(w, x.dtype)
    return LoraLinearFunction.apply(x, weight, bias, w.A, w.B, A_c, B_c, w.scale)


class LoraGroupFunction(torch.autograd.Function):
    """Several LoRA projections of one input (q, k, v; gate, up) of one adapter as one node.

    The parts' down-projections run as one GEMM over their stacked ``A`` (``A_cat``, rank rows
    per part), each part's output is its base GEMM plus its up-projection added in place, and
    the backward sums the input gradient of every part inside GEMMs (``addmm_``) instead of
    autograd adding the parts' gradients one full-size tensor at a time. Arguments after
    ``A_cat``: per part ``(weight, bias, B_c, A, B)``, the masters ``A``/``B`` receiving the
    gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, A_cat: torch.Tensor, *parts):
        n = len(parts) // 5
        weights, biases, Bs = parts[0::5], parts[1::5], parts[2::5]
        h = F.linear(x, A_cat)
        bounds, outs, start = [], [], 0
        for W, b, B_c in zip(weights, biases, Bs):
            r = B_c.shape[1]
            y = F.linear(x, W, b)
            y.addmm_(h[:, start:start + r], B_c.t(), alpha=scale)
            outs.append(y)
            bounds.append((start, start + r))
            start += r
        ctx.save_for_backward(x, h, A_cat, *weights, *Bs)
        ctx.scale, ctx.bounds, ctx.n, ctx.master_dtype = scale, bounds, n, parts[3].dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        x, h, A_cat, *rest = ctx.saved_tensors
        n, s, bounds = ctx.n, ctx.scale, ctx.bounds
        weights, Bs = rest[:n], rest[n:]
        need = ctx.needs_input_grad
        gh = torch.empty_like(h)
        for g, B_c, (a, b) in zip(gs, Bs, bounds):
            gh[:, a:b].addmm_(g, B_c, beta=0, alpha=s)  # beta=0: the uninitialised values are not read
        dx = None
        if need[0]:
            dx = torch.mm(gs[0], weights[0])
            for g, W in zip(gs[1:], weights[1:]):
                dx.addmm_(g, W)
            dx.addmm_(gh, A_cat)
        dA_cat = grad_mm(gh.t(), x, 1.0, ctx.master_dtype)
        grads: list = []
        for i, (g, (a, b)) in enumerate(zip(gs, bounds)):
            dA = dA_cat[a:b] if need[3 + 5 * i + 3] else None
            dB = grad_mm(g.t(), h[:, a:b], s, ctx.master_dtype) if need[3 + 5 * i + 4] else None
            grads += [None, None, None, dA, dB]
        return (dx, None, None, *grads)


def group_copies(ws: list, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The group's stacked ``A`` and each part's ``B`` in ``dtype`` (detached), kept on the first
    part's weights until a master changes (:func:`refresh_copies` makes them eagerly)."""
    key = group_key(ws, dtype)
    cached = ws[0].group
    if cached is None or cached[0] != key:
        refresh_copies([], dtype, [ws])
        cached = ws[0].group
    return cached[1], cached[2]


def lora_group(x: torch.Tensor, layers: list, ws: list) -> tuple[torch.Tensor, ...]:
    """Every ``layers[i]``'s ``x W_i^T (+ b_i) + scale (x A_i^T) B_i^T`` (2-D ``x``), one adapter
    ``ws[i]`` per layer, all of the same scale, through :class:`LoraGroupFunction`."""
    A_cat, Bs = group_copies(ws, x.dtype)
    args: list = []
    for layer, w, B_c in zip(layers, ws, Bs):
        args += [layer.weight, layer.bias, B_c, w.A, w.B]
    return LoraGroupFunction.apply(x, ws[0].scale, A_cat, *args)
