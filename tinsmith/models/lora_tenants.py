"""Several tenants' LoRA on one projection in training as a single autograd node.

A multi-tenant micro-batch lays each adapter's rows out contiguously (segments tiling the rows).
Written with torch's ops, each projection then left autograd a node per op per tenant, or, with
the grouped matmul, the adapters' stacking (casts, pads, a scale multiply, a cat) redone at every
forward and its backward at every backward, then the delta's add: on an H200 a four-tenant step
launched 7,667 kernels against one tenant's 4,341 and ran at 0.66-0.69x of its speed, the host
issuing launches for longer than the device ran them (docs/performance.md).

:class:`TenantsLoraFunction` computes ``y = x W^T (+ b)`` plus, for each segment ``i`` with an
adapter, ``scale_i (x_i A_i^T) B_i^T`` on its rows, with a hand-written backward, in one of two
ways:

- **grouped** (GPUs whose grouped matmul is fast, :func:`tinsmith.models.grouped_lora.multi_lora_path`):
  the adapters' compute copies stacked once per optimizer step (:func:`stacked_copies`: ranks
  zero-padded, each scale folded into its ``B``), then one ``torch._grouped_mm`` for every
  tenant's shrink and one for the expand, forward and backward; the adapters' gradients come out
  as two stacked tensors cast to the masters' dtype in one kernel each (the ``B`` side's scale
  in the same kernel);
- **loop** (elsewhere): each tenant's two GEMMs on its rows, the expand added into the base
  output and the input gradient's adapter part added into the base part inside GEMMs
  (``addmm_``), as :class:`tinsmith.models.lora_function.LoraLinearFunction` does for one.

Each tenant's gradients come from its own rows only and go to its own masters, so optimizer
state and isolation are as before; padded ranks and segments without an adapter contribute
zeros and get no gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tinsmith.models.copy_refresh import stack_entry
from tinsmith.models.grouped_lora import _group_scales, _round_up, group_offsets
from tinsmith.models.lora_function import compute_copies, grad_mm


@dataclass(frozen=True)
class TenantRows:
    """How a micro-batch's rows split among tenants for one projection: ``sizes[i]`` consecutive
    rows per segment, ``weights[i]`` its adapter on this projection (None: none), ``grouped``
    whether the grouped matmul runs them."""

    sizes: tuple[int, ...]
    weights: tuple
    grouped: bool


@dataclass(eq=False)
class TenantStack:
    """Several tenants' adapters of one layer stacked for training (:func:`stacked_copies`): the
    stacks, the segments' weights they hold, and what they were written from (``entries``: each
    segment's :func:`tinsmith.models.copy_refresh.stack_entry`). An optimizer step rewrites an
    adapter's rows and its entries in place (:class:`tinsmith.models.copy_refresh.CopyRefresh`);
    another mix of tenants makes a new one."""

    dtype: torch.dtype
    rank: int
    entries: list
    A: torch.Tensor
    B: torch.Tensor
    weights: tuple

    def current(self, weights: tuple, rank: int, dtype: torch.dtype) -> bool:
        """Whether these stacks hold ``weights`` as they are now, at ``rank`` in ``dtype``."""
        return (self.rank == rank and self.dtype == dtype and len(self.entries) == len(weights)
                and all(e == stack_entry(w) for e, w in zip(self.entries, weights)))


def stacked_copies(owner, weights: tuple, rank: int, dtype: torch.dtype, in_features: int,
                   out_features: int, A_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment's adapter in ``dtype`` as ``(segments, rank, in)`` and ``(segments, out,
    rank)`` (scale folded into ``B``; padding and segments without an adapter zero), kept on
    ``owner`` (the layer) until a master changes other than by an optimizer step's refresh
    (:class:`tinsmith.models.copy_refresh.CopyRefresh`) or the micro-batch's adapters do. A
    rebuild makes new tensors (one multi-tensor copy and one multiply); ``A_into`` (a view of a
    group's side-by-side buffer, zeroed) takes the ``A`` stack instead, and forces the rebuild."""
    cached = owner._tenant_stack
    if A_into is None and cached is not None and cached.current(weights, rank, dtype):
        return cached.A, cached.B
    like = next(w for w in weights if w is not None).A
    full = all(w is not None and w.A.shape[0] == rank for w in weights)
    new = torch.empty if full else torch.zeros
    A = new(len(weights), rank, in_features, dtype=dtype, device=like.device) if A_into is None else A_into
    B = new(len(weights), out_features, rank, dtype=dtype, device=like.device)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for i, w in enumerate(weights):
        if w is not None:
            _slices_of(A, B, i, w, dst, src)
    torch._foreach_copy_(dst, src)
    B.mul_(_group_scales(tuple(0.0 if w is None else float(w.scale) for w in weights), 1, dtype, like.device))
    owner._tenant_stack = TenantStack(dtype, rank, [stack_entry(w) for w in weights], A, B, weights)
    return A, B


def _slices_of(A: torch.Tensor, B: torch.Tensor, i: int, w, dst: list, src: list) -> torch.Tensor:
    """Add segment ``i``'s rows of the stacks (its rank's share) and ``w``'s masters to a
    multi-tensor copy's destinations and sources; returns the ``B`` slice (its scale to apply)."""
    r = w.A.shape[0]
    dst += [A[i, :r], B[i, :, :r]]
    src += [w.A.detach(), w.B.detach()]
    return B[i, :, :r]


def _plus_linear(delta: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``delta + x W^T (+ b)`` written into ``delta`` (the grouped expand's fresh output): the base
    GEMM adds into it (``addmm_``), one kernel where a GEMM and then an add of the expand were two,
    and the (rows, out) output is read and written once less."""
    if bias is not None:
        delta.add_(bias)
    return delta.addmm_(x, weight.t())


class TenantsLoraFunction(torch.autograd.Function):
    """See the module's docstring. Arguments after ``rows``: the present adapters' masters
    ``A_1, B_1, A_2, B_2, ...`` in segment order (what receives the gradients), then the
    compute tensors (grouped: the two stacks; loop: each present adapter's copies ``A_c, B_c``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: TenantRows,
                n_masters: int, *tensors):
        masters, compute = tensors[:n_masters], tensors[n_masters:]
        ctx.rows, ctx.n_masters = rows, n_masters
        ctx.master_dtype = masters[0].dtype
        if rows.grouped:
            A, B = compute
            offs = group_offsets(rows.sizes, x.device)
            h = torch._grouped_mm(x, A.transpose(1, 2), offs=offs)
            y = _plus_linear(torch._grouped_mm(h, B.transpose(1, 2), offs=offs), x, weight, bias)
            ctx.save_for_backward(x, weight, h, A, B)
            return y
        y = F.linear(x, weight, bias)
        hs, start, c = [], 0, iter(compute)
        for size, w in zip(rows.sizes, rows.weights):
            if w is not None:
                A_c, B_c = next(c), next(c)
                h = F.linear(x[start:start + size], A_c)
                y[start:start + size].addmm_(h, B_c.t(), alpha=w.scale)
                hs.append(h)
            start += size
        ctx.save_for_backward(x, weight, *compute, *hs)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        rows: TenantRows = ctx.rows
        g = g.contiguous()  # a broadcast gradient (a plain sum's) has no strides the GEMMs take
        need_x = ctx.needs_input_grad[0]
        need_masters = ctx.needs_input_grad[5:5 + ctx.n_masters]
        if rows.grouped:
            x, weight, h, A, B = ctx.saved_tensors
            offs = group_offsets(rows.sizes, x.device)
            gh = torch._grouped_mm(g, B, offs=offs)  # (rows, rank): B carries the scales
            # The adapters' part first, the base GEMM adding into it (no separate add: the grouped
            # matmul cannot accumulate into an output, a GEMM can).
            dx = torch._grouped_mm(gh, A, offs=offs).addmm_(g, weight) if need_x else None
            grads = _adapter_grads(ctx, rows, need_masters, x, [g], h, gh, offs)
            return (dx, None, None, None, None, *grads, None, None)  # the two stacks get none
        x, weight, *rest = ctx.saved_tensors
        n_present = sum(w is not None for w in rows.weights)
        compute, hs = rest[:2 * n_present], rest[2 * n_present:]
        dx = torch.mm(g, weight) if need_x else None
        grads: list = []
        start, k = 0, 0
        for size, w in zip(rows.sizes, rows.weights):
            if w is not None:
                A_c, B_c, h = compute[2 * k], compute[2 * k + 1], hs[k]
                xs, gs = x[start:start + size], g[start:start + size]
                gh = torch.addmm(h, gs, B_c, beta=0, alpha=w.scale)  # beta=0: h lends its shape only
                if dx is not None:
                    dx[start:start + size].addmm_(gh, A_c)
                need_a, need_b = need_masters[2 * k], need_masters[2 * k + 1]
                grads.append(grad_mm(gh.t(), xs, 1.0, ctx.master_dtype) if need_a else None)
                grads.append(grad_mm(gs.t(), h, w.scale, ctx.master_dtype) if need_b else None)
                k += 1
            start += size
        return (dx, None, None, None, None, *grads, *([None] * len(compute)))


def _adapter_grads(ctx, rows: TenantRows, need: tuple, x: torch.Tensor, gs: list[torch.Tensor], h: torch.Tensor,
                   gh: torch.Tensor, offs: torch.Tensor) -> list:
    """Every present adapter's (dA, dB) on each of the parts whose output gradients are ``gs``
    (one for a single projection), in the order of the masters (part after part, segment after
    segment): ``dA`` of all parts from one grouped product over ``gh`` (the parts' shrink
    gradients side by side, rows as the groups' reduction), ``dB`` one per part; each cast to the
    masters' dtype in one kernel, ``dB`` times each segment's scale in it."""
    rank = h.shape[1] // len(gs)
    dA = torch._grouped_mm(gh.t(), x, offs=offs).to(ctx.master_dtype) if any(need[0::2]) else None
    scales = _group_scales(tuple(0.0 if w is None else float(w.scale) for w in rows.weights), 1, ctx.master_dtype,
                           x.device)
    segments = [(i, w.A.shape[0]) for i, w in enumerate(rows.weights) if w is not None]
    present, parts = len(segments), len(gs)
    # One view per (segment, part) made by one call (``unbind``) rather than a slice each: a
    # slice costs the host microseconds, and a node of 16 tenants' q/k/v makes ~100 of them.
    dAs = dA.reshape(len(rows.weights) * parts, rank, dA.shape[-1]).unbind(0) if dA is not None else None
    grads: list = []
    for p, g in enumerate(gs):
        base = 2 * p * present
        dBs = None
        if any(need[base + 1: base + 2 * present: 2]):
            dB = torch.mul(torch._grouped_mm(g.t(), h[:, p * rank:(p + 1) * rank], offs=offs), scales)  # promoted
            dBs = dB.unbind(0)
        for j, (i, r) in enumerate(segments):
            a = dAs[i * parts + p] if need[base + 2 * j] else None  # type: ignore[index]
            b = dBs[i] if need[base + 2 * j + 1] else None  # type: ignore[index]
            if r != rank:  # a padded rank: the segment's own rows and columns
                a = None if a is None else a[:r]
                b = None if b is None else b[:, :r]
            grads += (a, b)
    return grads


def tenants_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner, sizes: tuple[int, ...],
                   weights: tuple, grouped: bool) -> torch.Tensor:
    """``x W^T (+ b)`` plus each segment's adapter on its rows (2-D ``x``; ``sizes`` tile its
    rows; ``weights[i]`` None for a segment without one) through :class:`TenantsLoraFunction`."""
    present = [w for w in weights if w is not None]
    masters = [t for w in present for t in (w.A, w.B)]
    if grouped:
        rank = _round_up(max(w.A.shape[0] for w in present), 8)
        compute = list(stacked_copies(owner, weights, rank, x.dtype, weight.shape[1], weight.shape[0]))
    else:
        compute = [t for w in present for t in compute_copies(w, x.dtype)]
    return TenantsLoraFunction.apply(x, weight, bias, TenantRows(sizes, weights, grouped), len(masters),
                                     *masters, *compute)


def _group_stacks(layers: tuple, weights: tuple[tuple, ...], rank: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A group's stacks: the parts' ``A`` side by side, ``(segments, parts x rank, in)``, each
    part's ``A`` stack a view of it (so an optimizer step's refresh of a part writes the grouped
    shrink's operand itself: no concatenation per step), and each part's ``B`` stack. Kept on the
    first layer while every part's stack is current and the one made with it."""
    cached = layers[0]._tenant_cat
    stacks = [layer._tenant_stack for layer in layers]
    if (cached is not None and all(map(operator.is_, stacks, cached[1]))
            and all(st.current(ws, rank, dtype) for st, ws in zip(stacks, weights))):
        return cached[0], [st.B for st in stacks]
    like = next(w for w in weights[0] if w is not None).A
    A_cat = torch.zeros(len(weights[0]), len(layers) * rank, like.shape[1], dtype=dtype, device=like.device)
    Bs = [stacked_copies(layer, ws, rank, dtype, layer.in_features, layer.out_features,
                         A_into=A_cat[:, p * rank:(p + 1) * rank])[1]
          for p, (layer, ws) in enumerate(zip(layers, weights))]
    layers[0]._tenant_cat = (A_cat, tuple(layer._tenant_stack for layer in layers))
    return A_cat, Bs


class TenantsGroupFunction(torch.autograd.Function):
    """Several projections of one input (q, k, v; gate, up), several tenants, grouped: one
    grouped shrink over the parts' stacked ``A`` side by side, then per part its base GEMM and
    its grouped expand; the backward sums the input gradient's base parts inside GEMMs and its
    adapter part in one grouped product over all parts. Arguments after ``n_masters``: per part
    ``(weight, bias, B_stack)``, then ``A_cat``, then the present adapters' masters per part
    (``A, B`` per segment with an adapter, part after part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: TenantRows, n_parts: int, n_masters: int, *tensors):
        parts = [tensors[3 * p: 3 * p + 3] for p in range(n_parts)]
        A_cat = tensors[3 * n_parts]
        masters = tensors[3 * n_parts + 1:]
        offs = group_offsets(rows.sizes, x.device)
        h = torch._grouped_mm(x, A_cat.transpose(1, 2), offs=offs)  # (rows, parts x rank)
        rank = A_cat.shape[1] // n_parts
        outs = [_plus_linear(torch._grouped_mm(h[:, p * rank:(p + 1) * rank], B.transpose(1, 2), offs=offs), x, W, b)
                for p, (W, b, B) in enumerate(parts)]
        ctx.save_for_backward(x, h, A_cat, *[W for W, _, _ in parts], *[B for _, _, B in parts])
        ctx.rows, ctx.n_parts, ctx.n_masters = rows, n_parts, n_masters
        ctx.master_dtype = masters[0].dtype if masters else x.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        rows: TenantRows = ctx.rows
        n = ctx.n_parts
        x, h, A_cat, *rest = ctx.saved_tensors
        Ws, Bs = rest[:n], rest[n:]
        gs = [g.contiguous() for g in gs]
        offs = group_offsets(rows.sizes, x.device)
        gh = torch.cat([torch._grouped_mm(g, B, offs=offs) for g, B in zip(gs, Bs)], dim=1)  # B carries the scales
        dx = None
        if ctx.needs_input_grad[0]:  # the adapters' part, every part's base GEMM adding into it
            dx = torch._grouped_mm(gh, A_cat, offs=offs)
            for g, W in zip(gs, Ws):
                dx.addmm_(g, W)
        need = ctx.needs_input_grad[4 + 3 * n + 1:]  # the masters': per part, per present segment (A, B)
        grads = _adapter_grads(ctx, rows, need, x, gs, h, gh, offs)
        return (dx, None, None, None, *([None] * (3 * n + 1)), *grads)


def tenants_group(x: torch.Tensor, layers: tuple, sizes: tuple[int, ...], weights: tuple[tuple, ...]
                  ) -> tuple[torch.Tensor, ...]:
    """Every ``layers[p]``'s output for 2-D ``x`` whose rows ``sizes`` tile, segment ``i`` with
    adapter ``weights[p][i]`` (the same tenant, rank and scale on every part, or None on all),
    through :class:`TenantsGroupFunction` (grouped: the caller has checked that it runs here)."""
    present = [w for w in weights[0] if w is not None]
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    A_cat, Bs = _group_stacks(layers, weights, rank, x.dtype)
    parts, masters = [], []
    for layer, ws, B in zip(layers, weights, Bs):
        parts += [layer.weight, layer.bias, B]
        masters += [t for w in ws if w is not None for t in (w.A, w.B)]
    return TenantsGroupFunction.apply(x, TenantRows(sizes, weights[0], True), len(layers), len(masters), *parts,
                                      A_cat, *masters)
