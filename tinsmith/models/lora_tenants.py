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

Projections of one input (q/k/v, gate/up) run as one node, :class:`TenantsGroupFunction`, whose
output holds the parts side by side: one grouped shrink and one grouped expand for all of them
(the ``B`` stacks block-diagonal), the base one GEMM over the packed weight, and the same
sharing backward. On a GPU each grouped matmul is a CUTLASS set-up on the host and two launches,
and a four-tenant step is bound by the host's launches (docs/performance.md): a layer's four
projections take 24 grouped matmuls instead of 33, and 8 base GEMMs instead of 14. The consumers
read the parts where they sit: the q/k norm and rotary kernels read heads in the wide row, the
SiLU kernel the gate and up halves.

Each tenant's gradients come from its own rows only and go to its own masters, so optimizer
state and isolation are as before; padded ranks and segments without an adapter contribute
zeros and get no gradient. The masters are not the node's inputs: its backward hands them their
gradients itself (:func:`_hand_out`, what autograd's gradient accumulation does for a leaf), since
autograd delivers a leaf's gradient through a node of its own (about 7 us of the host's time a
tensor on a CPU, and a tenant has two tensors per adapted projection: 392 on a 28-layer model,
several milliseconds a tenant and step). A leaf that requires a gradient and never gets one
(:func:`_anchor`) is the node's input instead, so autograd records the node where nothing else it
reads requires a gradient (the first layer's input, the base frozen).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tinsmith.models.copy_refresh import copy_pairs, stack_entry
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
        return self.rank == rank and self.dtype == dtype and self.entries == list(map(stack_entry, weights))


def stacked_copies(owner, weights: tuple, rank: int, dtype: torch.dtype, in_features: int,
                   out_features: int, A_into: torch.Tensor | None = None,
                   B_into: torch.Tensor | None = None, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment's adapter in ``dtype`` as ``(segments, rank, in)`` and ``(segments, out,
    rank)`` (scale folded into ``B``; padding and segments without an adapter zero), kept on
    ``owner`` (the layer) until a master changes other than by an optimizer step's refresh
    (:class:`tinsmith.models.copy_refresh.CopyRefresh`) or the micro-batch's adapters do. A
    rebuild makes new tensors (one multi-tensor copy and one multiply); ``A_into`` and ``B_into``
    (views of a group's buffers, zeroed) take the stacks instead, and force the rebuild.
    ``keep=False`` (a sampler's prefill): the kept stacks where they hold ``weights``, else stacks
    made for this call only, the kept ones left as they are (a sampler's many adapters would
    otherwise hold a second copy of themselves on every layer)."""
    cached = owner._tenant_stack
    if A_into is None and cached is not None and cached.current(weights, rank, dtype):
        return cached.A, cached.B
    like = next(w for w in weights if w is not None).A
    full = all(w is not None and w.A.shape[0] == rank for w in weights)
    new = torch.empty if full else torch.zeros
    A = new(len(weights), rank, in_features, dtype=dtype, device=like.device) if A_into is None else A_into
    B = new(len(weights), out_features, rank, dtype=dtype, device=like.device) if B_into is None else B_into
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for i, w in enumerate(weights):
        if w is not None:
            _slices_of(A, B, i, w, dst, src)
    copy_pairs(dst, src)  # a group's B blocks are strided: they must not take the dense pairs' launch with them
    B.mul_(_group_scales(tuple(0.0 if w is None else float(w.scale) for w in weights), 1, dtype, like.device))
    if keep:
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
    """See the module's docstring. Arguments after ``rows``: the :func:`_anchor`, then the
    compute tensors (grouped: the two stacks; loop: each present adapter's copies ``A_c, B_c``).
    The present adapters' masters (``rows.weights``) receive their gradients from the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: TenantRows,
                anchor: torch.Tensor, *compute):
        ctx.rows = rows
        ctx.masters = _masters((rows.weights,))
        ctx.master_dtype = ctx.masters[0].dtype
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
        need_masters = [p.requires_grad for p in ctx.masters]
        if rows.grouped:
            x, weight, h, A, B = ctx.saved_tensors
            offs = group_offsets(rows.sizes, x.device)
            gh = torch._grouped_mm(g, B, offs=offs)  # (rows, rank): B carries the scales
            # The adapters' part first, the base GEMM adding into it (no separate add: the grouped
            # matmul cannot accumulate into an output, a GEMM can).
            dx = torch._grouped_mm(gh, A, offs=offs).addmm_(g, weight) if need_x else None
            _hand_out(ctx.masters, _adapter_grads(ctx, rows, need_masters, x, g, ((0, g.shape[1]),), h, gh, offs))
            return dx, None, None, None, None, None, None  # the anchor and the two stacks get none
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
        _hand_out(ctx.masters, grads)
        return (dx, None, None, None, None, *([None] * len(compute)))


def _adapter_grads(ctx, rows: TenantRows, need: list[bool], x: torch.Tensor, g: torch.Tensor,
                   bounds: tuple[tuple[int, int], ...], h: torch.Tensor, gh: torch.Tensor, offs: torch.Tensor) -> list:
    """Every present adapter's (dA, dB) on each part of the output whose gradient is ``g`` (the
    parts' columns ``bounds``; one part for a single projection), in the order of the masters
    (part after part, segment after segment): ``dA`` of all parts from one grouped product over
    ``gh`` (the parts' shrink gradients side by side, rows as the groups' reduction), ``dB`` of
    all parts from one grouped product of ``g`` with ``h`` (a part's block of it is its ``dB``;
    the blocks across parts are not needed and cost a few FLOPs of a rank-wide product), each
    cast to the masters' dtype in one kernel, ``dB`` times each segment's scale in it."""
    parts = len(bounds)
    rank = h.shape[1] // parts
    dA = torch._grouped_mm(gh.t(), x, offs=offs).to(ctx.master_dtype) if any(need[0::2]) else None
    scales = _group_scales(tuple(0.0 if w is None else float(w.scale) for w in rows.weights), 1, ctx.master_dtype,
                           x.device)
    segments = [(i, w.A.shape[0]) for i, w in enumerate(rows.weights) if w is not None]
    present = len(segments)
    # One view per (segment, part) made by one call (``unbind``) rather than a slice each: a
    # slice costs the host microseconds, and a node of 16 tenants' q/k/v makes ~100 of them.
    dAs = dA.reshape(len(rows.weights) * parts, rank, dA.shape[-1]).unbind(0) if dA is not None else None
    dB_all = None
    if any(need[1::2]):
        dB_all = torch._grouped_mm(g.t(), h, offs=offs)  # (segments, out, parts x rank)
    grads: list = []
    for p, (lo, hi) in enumerate(bounds):
        base = 2 * p * present
        dBs = None
        if any(need[base + 1: base + 2 * present: 2]):
            block = dB_all if parts == 1 else dB_all[:, lo:hi, p * rank:(p + 1) * rank]  # type: ignore[index]
            dBs = torch.mul(block, scales).unbind(0)  # promoted to the masters' dtype, contiguous
        for j, (i, r) in enumerate(segments):
            a = dAs[i * parts + p] if need[base + 2 * j] else None  # type: ignore[index]
            b = dBs[i] if need[base + 2 * j + 1] else None  # type: ignore[index]
            if r != rank:  # a padded rank: the segment's own rows and columns
                a = None if a is None else a[:r]
                b = None if b is None else b[:, :r]
            grads += (a, b)
    return grads


def _masters(weights: tuple[tuple, ...]) -> list[torch.Tensor]:
    """The present adapters' masters of every part, in :func:`_adapter_grads`' order: part after
    part, segment after segment, ``A`` then ``B``."""
    return [t for ws in weights for w in ws if w is not None for t in (w.A, w.B)]


_anchors: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """The leaf every several-tenant node takes as an input on ``device`` (see the module's
    docstring): it requires a gradient, so autograd records the node, and is never given one."""
    anchor = _anchors.get(device)
    if anchor is None:
        anchor = _anchors[device] = torch.zeros((), device=device, requires_grad=True)
    return anchor


def _hand_out(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Give each master its gradient (None: none) as autograd gives a leaf its own: in the
    master's dtype (a GEMM without an fp32 output on this device gives the compute dtype), through
    the master's gradient hooks (``register_hook``); the tensor itself where the master has no
    gradient yet and the strides agree (a copy in the master's layout where they do not), else
    added into the one there (one multi-tensor add for all of them); then its post-accumulate
    hooks. A master standing in several segments of a node (the runtime's micro-batches give each
    adapter one, ordered by slot) gets each segment's part in turn, its hooks called on each."""
    into, adds, after = [], [], []
    for p, g in zip(masters, grads):
        if g is None:
            continue
        if g.dtype is not p.dtype:
            g = g.to(p.dtype)
        hooks = p._backward_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                out = hook(g)
                g = g if out is None else out
        if not (g.is_contiguous() and p.is_contiguous()) and g.stride() != p.stride():  # a padded rank's B block
            g = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(g)
        if p.grad is None:
            p.grad = g
        else:
            into.append(p.grad)
            adds.append(g)
        if p._post_accumulate_grad_hooks:
            after.append(p)
    if into:
        torch._foreach_add_(into, adds)
    for p in after:
        for hook in tuple(p._post_accumulate_grad_hooks.values()):
            hook(p)


def tenants_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner, sizes: tuple[int, ...],
                   weights: tuple, grouped: bool) -> torch.Tensor:
    """``x W^T (+ b)`` plus each segment's adapter on its rows (2-D ``x``; ``sizes`` tile its
    rows; ``weights[i]`` None for a segment without one) through :class:`TenantsLoraFunction`."""
    present = [w for w in weights if w is not None]
    if grouped:
        rank = _round_up(max(w.A.shape[0] for w in present), 8)
        compute = list(stacked_copies(owner, weights, rank, x.dtype, weight.shape[1], weight.shape[0]))
    else:
        compute = [t for w in present for t in compute_copies(w, x.dtype)]
    return TenantsLoraFunction.apply(x, weight, bias, TenantRows(sizes, weights, grouped), _anchor(x.device),
                                     *compute)


def _group_stacks(layers: tuple, weights: tuple[tuple, ...], rank: int, dtype: torch.dtype, keep: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's stacks: the parts' ``A`` side by side, ``(segments, parts x rank, in)``, and
    their ``B`` block-diagonal, ``(segments, sum of outs, parts x rank)``: part ``p``'s output
    columns read only its own rank's columns of ``h`` (the rest stay zero), so one grouped expand
    writes every part's output. Each part's stacks are views of these (so an optimizer step's
    refresh of a part writes the grouped operands themselves: no concatenation per step). Kept on
    the first layer while every part's stack is current and the one made with it; ``keep=False``
    (a sampler's prefill): as :func:`stacked_copies` says, nothing kept that is not already."""
    cached = layers[0]._tenant_cat
    stacks = [layer._tenant_stack for layer in layers]
    if (cached is not None and all(map(operator.is_, stacks, cached[2]))
            and all(st.current(ws, rank, dtype) for st, ws in zip(stacks, weights))):
        return cached[0], cached[1]
    like = next(w for w in weights[0] if w is not None).A
    segments, parts = len(weights[0]), len(layers)
    A_cat = torch.zeros(segments, parts * rank, like.shape[1], dtype=dtype, device=like.device)
    B_cat = torch.zeros(segments, sum(layer.out_features for layer in layers), parts * rank, dtype=dtype,
                        device=like.device)
    start = 0
    for p, (layer, ws) in enumerate(zip(layers, weights)):
        cols = slice(p * rank, (p + 1) * rank)
        A_part, B_part = A_cat[:, cols], B_cat[:, start:start + layer.out_features, cols]
        if keep:
            stacked_copies(layer, ws, rank, dtype, layer.in_features, layer.out_features, A_into=A_part, B_into=B_part)
        else:  # stacked dense first, then one copy each: a B block of the group is strided, and a
            # multi-tensor copy of strided blocks launches once per adapter on a GPU
            A, B = stacked_copies(layer, ws, rank, dtype, layer.in_features, layer.out_features, keep=False)
            A_part.copy_(A)
            B_part.copy_(B)
        start += layer.out_features
    if keep:
        layers[0]._tenant_cat = (A_cat, B_cat, tuple(layer._tenant_stack for layer in layers))
    return A_cat, B_cat


class TenantsGroupFunction(torch.autograd.Function):
    """Several projections of one input (q, k, v; gate, up), several tenants, grouped, as one
    output with the parts side by side: one grouped shrink over the parts' ``A`` side by side,
    one grouped expand over their block-diagonal ``B`` (:func:`_group_stacks`), and the base
    GEMMs added into it: one over the packed weight where the parts' weights are its columns
    (:class:`tinsmith.models.lora.PackedProjection`), else one per part into its columns. The
    backward mirrors it: one grouped product for every part's shrink gradient, the input
    gradient's adapter part in one grouped product and its base part inside GEMMs, the
    adapters' gradients from two grouped products (:func:`_adapter_grads`), handed to the present
    adapters' masters of every part (``weights``, a tuple of segments' weights per part).
    Arguments after ``weights``: the packed weight and bias (None: per part), the
    :func:`_anchor`, per part ``(weight, bias)``, then ``A_cat``, ``B_cat``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: TenantRows, outs: tuple[int, ...], weights: tuple[tuple, ...],
                packed_w: torch.Tensor | None, packed_b: torch.Tensor | None, anchor: torch.Tensor, *tensors):
        n = len(outs)
        Ws, bs = tensors[0:2 * n:2], tensors[1:2 * n:2]
        A_cat, B_cat = tensors[2 * n], tensors[2 * n + 1]
        offs = group_offsets(rows.sizes, x.device)
        h = torch._grouped_mm(x, A_cat.transpose(1, 2), offs=offs)  # (rows, parts x rank)
        y = torch._grouped_mm(h, B_cat.transpose(1, 2), offs=offs)  # (rows, sum of outs)
        bounds = _bounds(outs)
        if packed_w is not None:
            _plus_linear(y, x, packed_w.t(), packed_b)
        else:
            for W, b, (lo, hi) in zip(Ws, bs, bounds):
                _plus_linear(y[:, lo:hi], x, W, b)  # a GEMM writes a column block in place
        ctx.save_for_backward(x, h, A_cat, B_cat, packed_w, *Ws)
        ctx.rows, ctx.bounds, ctx.masters = rows, bounds, _masters(weights)
        ctx.master_dtype = ctx.masters[0].dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        rows: TenantRows = ctx.rows
        x, h, A_cat, B_cat, packed_w, *Ws = ctx.saved_tensors
        g = g.contiguous()
        offs = group_offsets(rows.sizes, x.device)
        gh = torch._grouped_mm(g, B_cat, offs=offs)  # (rows, parts x rank): B carries the scales
        dx = None
        if ctx.needs_input_grad[0]:  # the adapters' part, the base GEMMs adding into it
            dx = torch._grouped_mm(gh, A_cat, offs=offs)
            if packed_w is not None:
                dx.addmm_(g, packed_w.t())
            else:
                for W, (lo, hi) in zip(Ws, ctx.bounds):
                    dx.addmm_(g[:, lo:hi], W)
        need = [p.requires_grad for p in ctx.masters]  # per part, per present segment (A, B)
        _hand_out(ctx.masters, _adapter_grads(ctx, rows, need, x, g, ctx.bounds, h, gh, offs))
        return (dx, None, None, None, None, None, None, *([None] * (2 * len(ctx.bounds) + 2)))


def _bounds(outs: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Each part's columns of the side-by-side output."""
    ends = list(itertools.accumulate(outs))
    return tuple(zip([0] + ends[:-1], ends))


def tenants_group(x: torch.Tensor, layers: tuple, sizes: tuple[int, ...], weights: tuple[tuple, ...],
                  packed=None) -> torch.Tensor:
    """``layers``' outputs for 2-D ``x`` side by side, (rows, sum of outs), the rows ``sizes``
    tile, segment ``i`` with adapter ``weights[p][i]`` on part ``p`` (the same tenant, rank and
    scale on every part, or None on all), through :class:`TenantsGroupFunction` (grouped: the
    caller has checked that it runs here). ``packed``: the layers'
    :class:`tinsmith.models.lora.PackedProjection`, whose buffer makes the base one GEMM while
    the layers' weights are still its columns."""
    present = [w for w in weights[0] if w is not None]
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    A_cat, B_cat = _group_stacks(layers, weights, rank, x.dtype)
    parts = [t for layer in layers for t in (layer.weight, layer.bias)]
    whole = packed is not None and list(packed.layers) == list(layers) and packed.intact()
    return TenantsGroupFunction.apply(x, TenantRows(sizes, weights[0], True),
                                      tuple(layer.out_features for layer in layers), weights,
                                      packed.weight if whole else None, packed.bias if whole else None,
                                      _anchor(x.device), *parts, A_cat, B_cat)


def tenants_group_applied(x: torch.Tensor, layers: tuple, sizes: tuple[int, ...], weights: tuple[tuple, ...],
                          packed) -> torch.Tensor:
    """:func:`tenants_group`'s output without autograd (a sampler's prefill of several adapters'
    prompts, segments tiling the rows as in training): one grouped shrink and one grouped expand
    over the group's stacks (training's kept ones where they hold these adapters, else made for
    the call: a few launches whatever the number of adapters), and the base GEMM over
    ``packed``'s buffer added into them. Adapter by adapter, every segment took two GEMMs per
    part (q, k, v; gate, up), each a launch."""
    present = [w for w in weights[0] if w is not None]
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    A_cat, B_cat = _group_stacks(layers, weights, rank, x.dtype, keep=False)
    offs = group_offsets(sizes, x.device)
    h = torch._grouped_mm(x, A_cat.transpose(1, 2), offs=offs)  # (rows, parts x rank)
    y = torch._grouped_mm(h, B_cat.transpose(1, 2), offs=offs)  # (rows, sum of outs)
    return _plus_linear(y, x, packed.weight.t(), packed.bias)


def tenants_linear_applied(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner,
                           sizes: tuple[int, ...], weights: tuple) -> torch.Tensor:
    """:func:`tenants_linear`'s grouped output without autograd (a sampler's prefill of several
    adapters' prompts on one projection): the grouped shrink and expand over the adapters
    stacked by :func:`stacked_copies` (``owner``'s kept stacks where they hold them, else made
    for the call in a few launches), the base GEMM added into them. Stacked one adapter at a
    time (a cast, a pad and a scale each, then the stack), the adapters cost the host a few
    launches each per layer, every prefill."""
    present = [w for w in weights if w is not None]
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    A, B = stacked_copies(owner, weights, rank, x.dtype, weight.shape[1], weight.shape[0], keep=False)
    offs = group_offsets(sizes, x.device)
    y = torch._grouped_mm(torch._grouped_mm(x, A.transpose(1, 2), offs=offs), B.transpose(1, 2), offs=offs)
    return _plus_linear(y, x, weight, bias)
