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

import itertools

import torch
from torch.nn import functional as F

from tinsmith.models.copy_refresh import copy_key, group_key, refresh_copies

# False: a trained projection runs as torch's ops, each its own autograd node (as before these
# nodes existed): bench/gpu times a step both ways in one run.
FUSED_NODES = True
# How a q/k/v or gate/up group's up-projections (and their input gradients) run: "auto", one GEMM
# over the block-diagonal B on a GPU (where a step is bound by launches, and the products of a
# part's rows with the other parts' zero blocks cost a few percent of the base GEMM's FLOPs at a
# 2048-wide model), one GEMM per part elsewhere (a CPU, where launches are cheap and those FLOPs
# are not: a quarter of a 256-wide model's q/k/v GEMM); "one" or "per_part" to force either.
GROUP_UP_PROJECTIONS = "auto"


def up_projections_as_one(device: torch.device) -> bool:
    """Whether a group's up-projections run as one GEMM over the block-diagonal ``B`` here (see
    :data:`GROUP_UP_PROJECTIONS`)."""
    if GROUP_UP_PROJECTIONS != "auto":
        return GROUP_UP_PROJECTIONS == "one"
    return device.type == "cuda"

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


def plus_linear(delta: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``delta + x W^T (+ b)`` written into ``delta`` (an adapter's expand, fresh, or a column
    block of one): the base GEMM adds into it (``addmm_``), one kernel where a GEMM and then an
    add were two, and the (rows, out) output is read and written once less."""
    if bias is not None:
        delta.add_(bias)
    return delta.addmm_(x, weight.t())


def part_bounds(widths) -> tuple[tuple[int, int], ...]:
    """Each part's columns (or rows) when parts of ``widths`` sit side by side."""
    ends = list(itertools.accumulate(widths))
    return tuple(zip([0] + ends[:-1], ends))


def packed_weights(packed, layers) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``packed``'s (weight, bias), the layers' base as one ``(in, sum of outs)`` GEMM operand,
    while ``packed`` (a :class:`tinsmith.models.lora.PackedProjection`, or None) holds exactly
    these layers and their weights are still its columns; else (None, None): one GEMM per part."""
    if packed is None or list(packed.layers) != list(layers) or not packed.intact():
        return None, None
    return packed.weight, packed.bias


class LoraGroupFunction(torch.autograd.Function):
    """Several LoRA projections of one input (q, k, v; gate, up) of one adapter as one node,
    whose output holds the parts side by side.

    The parts' down-projections run as one GEMM over their stacked ``A`` (``A_cat``), their
    up-projections as one over their block-diagonal ``B`` (``B_cat``: part ``p``'s output columns
    read only its own rank's columns of ``h``) or one per part over its block
    (:func:`up_projections_as_one`), and the base GEMM adds into that: one over the packed weight
    where the parts' weights are its columns, else one per part into its columns.
    The backward mirrors it, summing the input gradient's parts inside GEMMs (``addmm_``).
    Arguments after ``B_cat``: the packed weight and bias (None: per part), then per part
    ``(weight, bias, A, B)``, the masters ``A``/``B`` receiving the gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, A_cat: torch.Tensor, B_cat: torch.Tensor,
                packed_w: torch.Tensor | None, packed_b: torch.Tensor | None, *parts):
        weights, biases, As = parts[0::4], parts[1::4], parts[2::4]
        h = F.linear(x, A_cat)
        bounds, ranks = part_bounds(W.shape[0] for W in weights), part_bounds(A.shape[0] for A in As)
        # The adapters' part first (beta=0: the fresh tensor only lends its shape), the base adding into it.
        y = x.new_empty(x.shape[0], B_cat.shape[0])
        one = up_projections_as_one(x.device)
        for (lo, hi), (a, b) in ([((0, y.shape[1]), (0, h.shape[1]))] if one else zip(bounds, ranks)):
            y[:, lo:hi].addmm_(h[:, a:b], B_cat[lo:hi, a:b].t(), beta=0, alpha=scale)
        if packed_w is not None:
            plus_linear(y, x, packed_w.t(), packed_b)
        else:
            for W, b, (lo, hi) in zip(weights, biases, bounds):
                plus_linear(y[:, lo:hi], x, W, b)
        ctx.save_for_backward(x, h, A_cat, B_cat, packed_w, *weights)
        ctx.scale, ctx.bounds, ctx.ranks, ctx.one = scale, bounds, ranks, one
        ctx.master_dtype = As[0].dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, h, A_cat, B_cat, packed_w, *weights = ctx.saved_tensors
        s = ctx.scale
        need = ctx.needs_input_grad
        g = g.contiguous()
        gh = torch.empty_like(h)  # every part's d(loss)/dh (beta=0: its values are not read)
        for (lo, hi), (a, b) in ([((0, g.shape[1]), (0, h.shape[1]))] if ctx.one else zip(ctx.bounds, ctx.ranks)):
            gh[:, a:b].addmm_(g[:, lo:hi], B_cat[lo:hi, a:b], beta=0, alpha=s)
        dx = None
        if need[0]:
            dx = torch.mm(gh, A_cat)
            if packed_w is not None:
                dx.addmm_(g, packed_w.t())
            else:
                for W, (lo, hi) in zip(weights, ctx.bounds):
                    dx.addmm_(g[:, lo:hi], W)
        want_a = need[8::4]
        dA_cat = grad_mm(gh.t(), x, 1.0, ctx.master_dtype) if any(want_a) else None
        grads: list = []
        for i, ((lo, hi), (a, b)) in enumerate(zip(ctx.bounds, ctx.ranks)):
            dA = dA_cat[a:b] if want_a[i] else None  # type: ignore[index]
            dB = grad_mm(g[:, lo:hi].t(), h[:, a:b], s, ctx.master_dtype) if need[9 + 4 * i] else None
            grads += [None, None, dA, dB]
        return (dx, None, None, None, None, None, *grads)


def group_copies(ws: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's stacked ``A`` and block-diagonal ``B`` in ``dtype`` (detached), kept on the
    first part's weights until a master changes (:func:`refresh_copies` makes them eagerly)."""
    key = group_key(ws, dtype)
    cached = ws[0].group
    if cached is None or cached[0] != key:
        refresh_copies([], dtype, [ws])
        cached = ws[0].group
    return cached[1], cached[2]


def lora_group(x: torch.Tensor, layers: list, ws: list, packed=None) -> torch.Tensor:
    """Every ``layers[i]``'s ``x W_i^T (+ b_i) + scale (x A_i^T) B_i^T`` side by side (2-D ``x``),
    one adapter ``ws[i]`` per layer, all of the same scale, through :class:`LoraGroupFunction`;
    ``packed``: the layers' :class:`tinsmith.models.lora.PackedProjection` (:func:`packed_weights`)."""
    A_cat, B_cat = group_copies(ws, x.dtype)
    args: list = []
    for layer, w in zip(layers, ws):
        args += [layer.weight, layer.bias, w.A, w.B]
    return LoraGroupFunction.apply(x, ws[0].scale, A_cat, B_cat, *packed_weights(packed, layers), *args)
