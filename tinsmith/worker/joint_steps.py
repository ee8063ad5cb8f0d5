"""Several units' optimizer steps taken together, each exactly as it would be alone.

When several tenants train in lockstep, their optimizer steps reach the engine together (the
SDK sends ``optim_step`` right behind ``forward_backward``), and each used to be its own step:
the gradient norm read back to the host (a wait for the device), AdamW's Python walking the
unit's few hundred tensors to build its lists, a multi-tensor kernel or two, and the refresh of
the adapter's compute copies. On a GPU the device has nothing queued during that host work, so
sixteen tenants' steps were sixteen stretches of idle device (docs/performance.md).

:func:`step_together` takes them as one: every gradient's norm in one multi-tensor call and one
read-back for all units; AdamW's kernels called directly on lists built from the units' state
(the step counts of every unit moved by one multi-tensor add; one fused AdamW call per set of
hyperparameters, since the kernel takes one learning rate); one multi-tensor copy refreshing
every unit's compute copies. What is per tensor stays off the host where it can: each unit keeps
its state dicts (:meth:`Trainable.adamw_state_lists`) and its gradients are read once.

Each unit's arithmetic is unchanged: the same per-tensor kernels with the same arguments and the
same per-unit norm (its own tensors' norms stacked, squared, summed), so a unit's weights after a
joint step are bit-identical to its step alone, whoever else stepped with it
(tests/worker/test_joint_steps.py).

Units that step differently (Dimuon) step alone, in order, through :meth:`Trainable.step`. A
sharded runtime says which of its units join and how their norms are summed over its ranks
(``joins``, ``norms``: :class:`tinsmith.parallel.runtime.TPTrainingRuntime`). One unit's refusal
(mismatched hyperparameters, non-finite gradients) is its own result; the others step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.adam import adam as adam_functional

from tinsmith.engine.device_faults import device_fault
from tinsmith.errors import TinsmithError
from tinsmith.models.copy_refresh import refresh_together
from tinsmith.optim import ADAMW, check_params_match, steps_on_device
from tinsmith.types import AdamParams, OptimParams
from tinsmith.worker.trainables import SKIPPED_NO_GRAD, Trainable

StepResult = dict[str, float] | Exception


Norms = Callable[[list[tuple[Trainable, list[torch.Tensor]]]], list[float]]


def step_together(units: list[Trainable], hps: list[OptimParams], joins: Callable[[Trainable], bool] | None = None,
                  norms: Norms | None = None) -> list[StepResult]:
    """Step every unit with its hyperparameters; each entry of the result is that unit's
    metrics or the error that refused its step (nothing of it applied).

    ``joins`` says which units step together (default :func:`steps_jointly`), ``norms`` gives
    their gradient norms, read back at once (default: each unit's own tensors'). A sharded
    runtime passes its units' kind and norms that count every shard once (one collective for
    all units)."""
    joins = joins or steps_jointly
    results: list[StepResult | None] = [None] * len(units)
    joint: list[tuple[int, Trainable, AdamParams, list[torch.Tensor], list[torch.Tensor]]] = []
    for i, (u, hp) in enumerate(zip(units, hps)):
        if not joins(u):
            results[i] = _alone(u, hp)
            continue
        try:
            check_params_match(u.optimizer_type, hp)
        except TinsmithError as exc:
            results[i] = exc
            continue
        params, grads = u.stepped_grads()
        if not params:
            results[i] = dict(SKIPPED_NO_GRAD)
            continue
        joint.append((i, u, hp, params, grads))
    if joint:
        got = (norms([(u, params) for _, u, _, params, _ in joint]) if norms is not None
               else _grad_norms([grads for *_, grads in joint]))
        stepping = []
        for (i, u, hp, params, grads), norm in zip(joint, got):
            try:
                u.clip(params, norm, hp)
            except TinsmithError as exc:
                results[i] = exc
                continue
            stepping.append((u, hp, params, grads))
            results[i] = {"grad_norm": norm, "learning_rate": hp.learning_rate}
        for u, hp, _, _ in stepping:
            u.before_step(hp)
        with torch.no_grad():  # as torch's optimizers step
            _adamw(stepping)
        for u, _, params, _ in stepping:
            u.after_step(params)
        refresh_together([r for r in (u.copy_refresh() for u, *_ in stepping) if r is not None])
    return results  # type: ignore[return-value]


def step_one(unit: Trainable, hp: OptimParams) -> dict[str, float]:
    """One unit's step (its metrics; a refusal raised): a plain AdamW unit's by
    :func:`step_together`'s kernel calls, with the same result bit for bit as its optimizer's own
    ``step()``, which :meth:`Trainable.step` takes for every other unit. torch's optimizer
    finds each tensor's state and gradient in Python at every step (a dict lookup, a few checks
    and list appends a tensor: 1 to 1.8 ms of host time a step on the CPU box, a 28-layer model with
    every linear layer adapted, docs/performance.md), where the joint step reads lists kept per unit."""
    if not steps_jointly(unit):
        return unit.step(hp)
    (result,) = step_together([unit], [hp])
    if isinstance(result, Exception):
        raise result
    return result


def steps_jointly(unit: Trainable) -> bool:
    """Whether ``unit`` steps as a plain AdamW unit does (its own norm, torch's foreach or fused
    AdamW over one parameter group), so that :func:`step_together` may take its step."""
    return type(unit) is Trainable and plain_adamw(unit)


def plain_adamw(unit: Trainable) -> bool:
    """Whether ``unit``'s optimizer is torch's AdamW, foreach or fused, over one parameter group
    and without the options :func:`step_together`'s kernel calls leave out."""
    if unit.optimizer_type != ADAMW:
        return False
    groups = unit.optimizer.param_groups
    g = groups[0] if len(groups) == 1 else {}
    return (bool(g.get("foreach") or g.get("fused")) and not g.get("amsgrad", True) and not g.get("maximize", True)
            and not g.get("capturable", True) and not g.get("differentiable", True))


def _alone(unit: Trainable, hp: OptimParams) -> StepResult:
    return result_of(unit.step, hp)


def result_of(fn: Callable[..., dict[str, float]], *args: Any) -> StepResult:
    """``fn(*args)``, or the error it raised as one unit's result (the other units still step).
    An error that means the device or the process group failed is raised instead: the call as
    a whole fails, as the engine must see it (:mod:`tinsmith.engine.device_faults`), rather than
    each further unit meeting the broken device or waiting out a dead peer in turn."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 (see above)
        if device_fault(exc) is not None:
            raise
        return exc


def _grad_norms(grads: list[list[torch.Tensor]]) -> list[float]:
    """Each unit's global gradient norm from its ``grads`` (as :meth:`Trainable.grad_norm`
    computes it: its tensors' norms stacked, squared and summed), from one multi-tensor norm
    call, read back at once."""
    each = torch._foreach_norm([g for gs in grads for g in gs], 2, dtype=torch.float32)
    norms, a = [], 0
    for gs in grads:
        b = a + len(gs)
        norms.append(torch.stack(each[a:b]).square().sum().sqrt())
        a = b
    return torch.stack(norms).tolist()


def _adamw(stepping: list[tuple[Trainable, AdamParams, list[torch.Tensor], list[torch.Tensor]]]) -> None:
    """AdamW's update of every unit's ``params`` (with their ``grads``), by the kernels its
    optimizer would launch."""
    fused_steps: list[torch.Tensor] = []
    calls: dict[tuple, tuple[list, list, list, list, list]] = {}
    for u, hp, params, grads in stepping:
        fused = steps_on_device(u.optimizer)
        key = (fused, params[0].device, hp.learning_rate, hp.beta1, hp.beta2, hp.weight_decay, hp.eps)
        ps, gs, ms, vs, ss = calls.setdefault(key, ([], [], [], [], []))
        kept = u.adamw_state_lists() if params is u.params else None
        if kept is None:  # some tensor without its state yet, or not every tensor stepping
            state = u.optimizer.state
            for p in params:
                if not state[p]:
                    _init_state(state[p], p, fused)
            kept = ([state[p]["exp_avg"] for p in params], [state[p]["exp_avg_sq"] for p in params],
                    [state[p]["step"] for p in params])
        ps += params
        gs += grads
        ms += kept[0]
        vs += kept[1]
        ss += kept[2]
        if fused:
            fused_steps += kept[2]
    if fused_steps:
        torch._foreach_add_(fused_steps, 1)  # every fused unit's step counts at once
    for (fused, _, lr, beta1, beta2, weight_decay, eps), (ps, gs, ms, vs, ss) in calls.items():
        if fused:
            torch._fused_adamw_(ps, gs, ms, vs, [], ss, amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=None, found_inf=None)
        else:
            adam_functional(ps, gs, ms, vs, [], ss, foreach=True, decoupled_weight_decay=True, amsgrad=False,
                            beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


def _init_state(st: dict, p: torch.Tensor, fused: bool) -> None:
    """A parameter's AdamW state before its first step, as torch's AdamW makes it: the step count
    a 0-d fp32 tensor (beside the parameter when fused, on the host otherwise), zero moments."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    st["step"] = (torch.zeros((), dtype=scalar, device=p.device) if fused
                  else torch.tensor(0.0, dtype=scalar, device="cpu"))
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
