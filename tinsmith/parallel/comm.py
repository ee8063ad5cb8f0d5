"""Collectives of the tensor-parallel group, as autograd functions where gradients flow through.

Megatron's pair: :func:`copy_to_tp` marks where a replicated activation enters sharded compute
(identity forward; backward sums the ranks' partial input gradients) and :func:`reduce_from_tp`
where sharded partial results leave it (forward sums them; backward passes the replicated
gradient through). :func:`sum_replicated_grads` gives the tensors every rank holds whole (LoRA
factors that are not split) the sum of the ranks' partial gradients, as data parallelism does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinsmith.parallel.group import TPGroup, guarded


def all_reduce_(t: torch.Tensor, tp: TPGroup, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "all_reduce") -> torch.Tensor:
    """Reduce ``t`` over the group in place (nothing to do in a group of one)."""
    if tp.size > 1:
        guarded(tp, what, lambda: dist.all_reduce(t, op=op, group=tp.group))
    return t


def all_gather_cat(t: torch.Tensor, tp: TPGroup, dim: int, what: str = "all_gather") -> torch.Tensor:
    """Every rank's ``t`` (equal shapes), concatenated along ``dim`` in rank order."""
    if tp.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    guarded(tp, what, lambda: dist.all_gather(parts, t.contiguous(), group=tp.group))
    return torch.cat(parts, dim=dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.contiguous().clone(), ctx.tp, what="input-gradient all_reduce"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return all_reduce_(x.contiguous().clone(), tp, what="output all_reduce")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp, ctx.width = tp, x.shape[-1]
        return all_gather_cat(x, tp, dim=-1, what="output all_gather")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a = ctx.tp.rank * ctx.width
        return grad[..., a : a + ctx.width].contiguous(), None


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension; the gradient of this rank's part
    is its slice of the (replicated) output gradient."""
    if tp.size == 1:
        return x
    return _GatherFromTP.apply(x, tp)


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (a replicated input of sharded work)."""
    if tp.size == 1:
        return x
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum of every rank's ``x`` forward; the gradient passes through unchanged."""
    if tp.size == 1:
        return x
    if not torch.is_grad_enabled() or not x.requires_grad:
        return all_reduce_(x.contiguous(), tp, what="output all_reduce")
    return _ReduceFromTP.apply(x, tp)


def mark_replicated(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a trainable tensor every rank holds whole (a LoRA factor that is not split).

    Each rank's backward leaves only its partial gradient in it; :func:`sum_replicated_grads`
    adds them up over the ranks once, before the optimizer step, rather than one collective per
    tensor per backward (summing is linear, so the result is the same).
    """
    t._tp_replicated = True
    return t


def is_replicated(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_tp_replicated", False))


def mark_shared(t: torch.Tensor, dim: int, rows: torch.Tensor, full: int) -> torch.Tensor:
    """Mark ``t`` as rows ``rows`` (along ``dim``, of ``full``) of a tensor whose parts some ranks
    hold alike: the LoRA ``B`` of a key/value head kept by several ranks when the tensor-parallel
    size exceeds the key/value heads. Each such rank's backward leaves a partial gradient, which
    :func:`sum_shared_grads` adds up among the ranks holding the same rows."""
    t._tp_shared = (dim, rows, full)
    return t


def shared_copies(t: torch.Tensor, tp: TPGroup) -> int:
    """How many ranks hold ``t``'s rows (1: a plain shard)."""
    shared = getattr(t, "_tp_shared", None)
    return 1 if shared is None else tp.size * len(shared[1]) // shared[2]


def sum_shared_grads(params: list[torch.Tensor], tp: TPGroup) -> None:
    """Sum the partial gradients of :func:`mark_shared` tensors among the ranks holding the same
    rows: each rank adds its part at its rows of a full-size buffer, one all-reduce adds them all,
    and each takes its rows back (every rank must pass the same tensors in the same order)."""
    shared = [p for p in params if getattr(p, "_tp_shared", None) is not None and p.grad is not None]
    if tp.size == 1 or not shared:
        return
    fulls = []
    for p in shared:
        dim, rows, full = p._tp_shared
        shape = list(p.grad.shape)
        shape[dim] = full
        fulls.append(p.grad.new_zeros(shape).index_add_(dim, rows.to(p.grad.device), p.grad))
    flat = all_reduce_(torch.cat([f.reshape(-1) for f in fulls]), tp, what="shared-gradient all_reduce")
    for p, f, v in zip(shared, fulls, flat.split([f.numel() for f in fulls])):
        dim, rows, _ = p._tp_shared
        p.grad.copy_(v.view_as(f).index_select(dim, rows.to(p.grad.device)))


def sum_replicated_grads(params: list[torch.Tensor], tp: TPGroup) -> None:
    """Sum the gradients of the replicated tensors among ``params`` over the ranks, in place, in
    one all-reduce of a flat buffer (every rank must pass the same tensors in the same order)."""
    grads = [p.grad for p in params if is_replicated(p) and p.grad is not None]
    if tp.size == 1 or not grads:
        return
    flat = all_reduce_(torch.cat([g.reshape(-1) for g in grads]), tp, what="replicated-gradient all_reduce")
    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])


def sum_grads(params: list[torch.Tensor], group: TPGroup) -> None:
    """Sum the gradients of ``params`` over the ranks of a data-parallel group, in place, in one
    all-reduce (every rank must pass the same tensors in the same order).

    A rank that ran none of a step's datums holds no gradient (``None``): it counts as zero, and
    a tensor no rank has a gradient for keeps ``None``, as one process that ran everything would.
    """
    if group.size == 1 or not params:
        return
    held = [p.grad is not None for p in params]
    dtype = next((p.grad.dtype for p in params if p.grad is not None), params[0].dtype)
    parts = [torch.tensor(held, dtype=dtype, device=params[0].device)]
    parts += [(p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype)).reshape(-1) for p in params]
    flat = all_reduce_(torch.cat(parts), group, what="data-parallel gradient all_reduce")
    anyone = flat[: len(params)].tolist()
    for p, v, seen in zip(params, flat[len(params):].split([p.numel() for p in params]), anyone):
        if seen:
            p.grad = v.view_as(p).clone() if p.grad is None else p.grad.copy_(v.view_as(p))
