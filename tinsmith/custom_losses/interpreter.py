"""Run a decoded custom loss on one datum, within bounds on tensor size and run time.

Each step runs twice: first on meta tensors (shapes and dtypes, no data, no memory), which
gives the size of what it would make, then, if that size is within the limit, for real. A
tensor factory asked for ``10**12`` elements is refused before anything is allocated; a shape
mismatch is reported by the meta run with the same message torch would give. The few calls
whose output size depends on tensor values (boolean masks, ``nonzero``) cannot be checked
first, but never make more elements than their input holds. A wall-clock deadline is checked
between steps, and the elements made by one run are capped in total as well.

Every failure is an :class:`InvalidInputError` that names the loss, the node and the datum.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any

import torch

from tinsmith.custom_losses import allowed
from tinsmith.custom_losses.program import DEVICE, INT64_MAX, INT64_MIN, CustomLoss, Ref, SliceArg, Step
from tinsmith.errors import InvalidInputError

# One run may make this many times the per-tensor limit in all.
TOTAL_ELEMENTS_FACTOR = 16
_MAX_SEQUENCE = 64  # Python tuples/lists a loss may build (shapes, split sizes)
_MAX_POW_EXPONENT = 1024  # Python-number powers: larger ones only make huge integers slowly
_META = torch.device("meta")


@dataclass(frozen=True)
class RunLimits:
    """Bounds for running a custom loss for one request."""

    max_elements: int  # per tensor
    timeout_s: float  # wall clock for every run of the loss for one request


class _StepError(Exception):
    """A step was refused or failed; the caller adds the loss, node and datum to the message."""


def run_loss(
    loss: CustomLoss, values: list[Any], device: torch.device, limits: RunLimits, deadline: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run ``loss`` on one datum's ``values`` (logprobs, then each input) and return its scalar
    loss and its metrics. Raises :class:`InvalidInputError` naming the node that failed."""
    values = list(values)
    made = [0]
    for step in loss.steps:
        if time.monotonic() > deadline:
            raise InvalidInputError(
                f"custom loss {loss.name!r} ran past its time limit of {limits.timeout_s:g} s (all its runs "
                f"for one request) at node {step.name!r} (--custom-loss-timeout-s)"
            )
        try:
            values.append(_run_step(step, values, device, limits, made))
        except _StepError as e:
            raise InvalidInputError(f"custom loss {loss.name!r} failed at node {step.name!r} ({step.target}): {e}") from None
        except (RuntimeError, TypeError, ValueError, IndexError, ArithmeticError, NotImplementedError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidInputError(
                f"custom loss {loss.name!r} failed at node {step.name!r} ({step.target}): {first_line[:300]}"
            ) from None
    out = values[loss.loss.index]
    if not isinstance(out, torch.Tensor) or out.ndim != 0 or not out.is_floating_point():
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidInputError(f"custom loss {loss.name!r} must return a scalar floating-point loss, got {shape}")
    metrics = {}
    for key, ref in loss.metrics.items():
        value = values[ref.index]
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise InvalidInputError(
                f"custom loss {loss.name!r} metric {key!r} must be a scalar, got shape {tuple(value.shape)}"
            )
        metrics[key] = value
    return out, metrics


_warmed = False


def warm_up() -> None:
    """Run one meta-tensor call, so that torch's one-time set-up of meta kernels (seconds on a
    slow machine) is not counted against the first loss's time limit."""
    global _warmed
    if not _warmed:
        torch.empty(2, device=_META).mul(2).expand(2, 2)
        _warmed = True


# --------------------------------------------------------------------------------- one step
def _run_step(step: Step, values: list[Any], device: torch.device, limits: RunLimits, made: list[int]) -> Any:
    args = tuple(_materialise(a, values, device) for a in step.args)
    kwargs = {k: _materialise(v, values, device) for k, v in step.kwargs.items()}
    if step.kind == "attribute":
        if not isinstance(args[0], torch.Tensor):
            raise _StepError(f"reads .{step.target} of a {type(args[0]).__name__}, not of a tensor")
        return getattr(args[0], step.target)  # step.target is one of allowed.TENSOR_ATTRIBUTES
    call = _callable(step, args)
    # Whatever device a loss names (a string such as "cuda:1" included), it runs where the server runs it.
    if "device" in kwargs or (step.kind == "function" and step.target in allowed.FACTORIES):
        kwargs["device"] = device
    if step.target == "to":  # .to("cuda") or .to(other_device)
        args = tuple(device if isinstance(a, (str, torch.device)) else a for a in args)
    if not _has_tensor(args) and not _has_tensor(kwargs) and step.target not in allowed.FACTORIES:
        return _python_op(step, call, args, kwargs)
    if step.target in allowed.SPLITTING:
        _check_pieces(step, args, kwargs)
    _check_size_first(step, call, args, kwargs, limits)
    out = call(*args, **kwargs)
    _check_result(out, limits, made)
    return out


def _callable(step: Step, args: tuple[Any, ...]) -> Any:
    if step.kind == "function":
        return step.fn
    if not isinstance(args[0], torch.Tensor):
        raise _StepError(f"calls .{step.target}() on a {type(args[0]).__name__}, not on a tensor")
    return getattr(torch.Tensor, step.target)  # step.target is one of allowed.METHODS


def _materialise(a: Any, values: list[Any], device: torch.device) -> Any:
    if isinstance(a, Ref):
        return values[a.index]
    if isinstance(a, SliceArg):
        return slice(*(_materialise(x, values, device) for x in (a.start, a.stop, a.step)))
    if a is DEVICE:
        return device
    if isinstance(a, tuple):
        return tuple(_materialise(x, values, device) for x in a)
    if isinstance(a, list):
        return [_materialise(x, values, device) for x in a]
    return a


def _has_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_has_tensor(y) for y in x)
    if isinstance(x, dict):
        return any(_has_tensor(y) for y in x.values())
    if isinstance(x, slice):
        return any(_has_tensor(y) for y in (x.start, x.stop, x.step))
    return False


# --------------------------------------------------------------------------------- size checks
def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device=_META)
    if isinstance(x, torch.device):
        return _META
    if isinstance(x, tuple) and not isinstance(x, torch.Size):
        return tuple(_to_meta(y) for y in x)
    if isinstance(x, list):
        return [_to_meta(y) for y in x]
    if isinstance(x, slice):
        return slice(*(_to_meta(y) for y in (x.start, x.stop, x.step)))
    return x


def _check_size_first(step: Step, call: Any, args: tuple, kwargs: dict, limits: RunLimits) -> None:
    """Refuse a call that would make too large a tensor, before it runs: by shape arithmetic for
    calls bounded by their inputs, by a run on meta tensors for the rest."""
    if step.target in allowed.BOUNDED_BY_INPUTS:
        bound = _broadcast_numel(_tensors(args) + _tensors(list(kwargs.values())))
        if bound > limits.max_elements:
            raise _StepError(
                f"it would make a tensor of {bound} elements, above this server's limit of "
                f"{limits.max_elements} (--custom-loss-max-elements)"
            )
        return
    try:
        shaped = call(*_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
    except NotImplementedError:
        if step.target in allowed.DATA_DEPENDENT:
            return  # output size depends on values, and never exceeds the input's
        raise _StepError("its result size cannot be checked before it runs, so it is not run") from None
    except RuntimeError as e:
        if "meta" in str(e).lower() and step.target in allowed.DATA_DEPENDENT:
            return
        raise
    for t in _tensors(shaped):
        if t.numel() > limits.max_elements:
            raise _StepError(
                f"it would make a tensor of shape {tuple(t.shape)} ({t.numel()} elements), above this "
                f"server's limit of {limits.max_elements} (--custom-loss-max-elements)"
            )


def _check_pieces(step: Step, args: tuple, kwargs: dict) -> None:
    """Refuse a split into more pieces than a loss may hold (each piece is a Python object)."""
    tensor, rest = args[0], list(args[1:])
    if not isinstance(tensor, torch.Tensor):
        return  # the call itself refuses it
    name = step.target.rsplit(".", 1)[-1]
    size = rest.pop(0) if rest and name != "unbind" else kwargs.get("split_size_or_sections",
                                                                     kwargs.get("split_size", kwargs.get("chunks")))
    dim = rest[0] if rest else kwargs.get("dim", 0)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -max(tensor.ndim, 1) <= dim < max(tensor.ndim, 1):
        return  # the call itself refuses it
    length = tensor.shape[dim] if tensor.ndim else 1
    if name == "unbind":
        pieces = length
    elif isinstance(size, int) and not isinstance(size, bool) and size > 0:
        pieces = size if name == "chunk" else -(-length // size)
    else:
        return  # a list of sizes is bounded by the argument limits; anything else is refused by the call
    if pieces > _MAX_SEQUENCE:
        raise _StepError(f"it would make {pieces} pieces; a custom loss may make at most {_MAX_SEQUENCE}")


def _broadcast_numel(tensors: list[torch.Tensor]) -> int:
    """Elements of the tensors' broadcast shape; where they do not broadcast, of the largest."""
    ndim = max((t.ndim for t in tensors), default=0)
    shape = [1] * ndim
    for t in tensors:
        for i, d in enumerate(t.shape, start=ndim - t.ndim):
            if d != shape[i] and shape[i] != 1 and d != 1:
                return max(t.numel() for t in tensors)
            shape[i] = d if shape[i] == 1 else shape[i]
    return math.prod(shape)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def _check_result(out: Any, limits: RunLimits, made: list[int], depth: int = 0) -> None:
    """Only tensors, numbers, shapes, dtypes and devices (and small tuples of them) flow between steps."""
    if isinstance(out, torch.Tensor):
        if out.numel() > limits.max_elements:
            raise _StepError(f"it made a tensor of {out.numel()} elements, above the limit of {limits.max_elements}")
        made[0] += out.numel()
        if made[0] > TOTAL_ELEMENTS_FACTOR * limits.max_elements:
            raise _StepError(
                f"the loss has made {made[0]} tensor elements in all, above {TOTAL_ELEMENTS_FACTOR} x "
                f"--custom-loss-max-elements"
            )
        return
    if isinstance(out, bool) or out is None or isinstance(out, (float, torch.dtype, torch.device)):
        return
    if isinstance(out, int):
        if not INT64_MIN <= out <= INT64_MAX:
            raise _StepError("it made an integer outside the int64 range")
        return
    if isinstance(out, (tuple, list)) and depth < 2 and len(out) <= _MAX_SEQUENCE:
        for x in out:
            _check_result(x, limits, made, depth + 1)
        return
    raise _StepError(f"it returned a {type(out).__name__}, which a custom loss cannot use")


# --------------------------------------------------------------------------------- Python numbers
def _python_op(step: Step, call: Any, args: tuple, kwargs: dict) -> Any:
    """An operator or math call on Python values (shape arithmetic such as ``x.shape[0] - 1``)."""
    if kwargs:
        raise _StepError("takes no keyword arguments on Python values")
    if step.kind != "function" or step.target.split(".")[0] not in ("operator", "math"):
        raise _StepError("needs a tensor argument")
    if step.fn is operator.getitem:
        seq, index = args
        if not isinstance(seq, (tuple, list)) or not isinstance(index, (int, slice)):
            raise _StepError("indexes only shapes and tuples with integers or slices")
        return seq[index]
    if step.fn is operator.add and all(isinstance(a, (tuple, list)) for a in args):
        if sum(len(a) for a in args) > _MAX_SEQUENCE:
            raise _StepError(f"would build a sequence longer than {_MAX_SEQUENCE}")
        return args[0] + args[1]
    if not all(isinstance(a, (int, float)) for a in args):
        names = ", ".join(type(a).__name__ for a in args)
        raise _StepError(f"applies to numbers (or a tensor), got {names}")
    if step.fn in (operator.pow, math.pow) and len(args) == 2 and abs(args[1]) > _MAX_POW_EXPONENT:
        raise _StepError(f"raises a Python number to the power {args[1]}, above {_MAX_POW_EXPONENT}")
    out = call(*args)
    if isinstance(out, int) and not isinstance(out, bool) and not INT64_MIN <= out <= INT64_MAX:
        raise _StepError("it made an integer outside the int64 range")
    return out
