"""Decode an uploaded custom loss (a torch.fx graph as data) into a checked program.

Decoding never executes anything and never resolves a name outside :mod:`.allowed`: every
node's target is looked up in the allow-lists, every argument is one of the few encoded forms
the SDK writes (numbers, strings, ``None``, lists, tuples, slices, ``...``, dtypes, devices,
references to earlier nodes), and the graph is bounded in nodes and argument size. The first
thing that breaks a rule is refused with an :class:`InvalidInputError` naming the node.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinsmith.custom_losses import allowed
from tinsmith.errors import InvalidInputError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_ARG_DEPTH = 4  # nesting of lists/tuples/slices inside one argument
MAX_ARG_ITEMS = 256  # scalars and references in all of one node's arguments
MAX_STRING = 64
MAX_INPUTS = 16  # the SDK's own cap, logprobs included

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


@dataclass(frozen=True)
class Ref:
    """A reference to the value of an earlier node (by position in the program)."""

    index: int


@dataclass(frozen=True)
class SliceArg:
    """A slice whose bounds may be references (``x[:n]`` with ``n`` computed)."""

    start: Any
    stop: Any
    step: Any


class Device:
    """Any device argument: the loss runs where the server runs it, whatever device was traced."""

    def __repr__(self) -> str:
        return "<run device>"


DEVICE = Device()


@dataclass(frozen=True)
class Step:
    """One call of the program: a function from :data:`allowed.FUNCTIONS`, a Tensor method, or
    an attribute read."""

    name: str
    kind: str  # "function" | "method" | "attribute"
    target: str  # the wire name, for messages
    fn: Callable[..., Any] | None  # for functions
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class LossInput:
    name: str
    rank: int


@dataclass(frozen=True)
class CustomLoss:
    """A decoded, checked custom loss: ``inputs`` feed the first ``len(inputs)`` values, each
    step appends one value, and the loss and metrics are references into those values."""

    name: str
    inputs: tuple[LossInput, ...]
    steps: tuple[Step, ...]
    loss: Ref
    metrics: dict[str, Ref]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads (every input after ``logprobs``)."""
        return tuple(x.name for x in self.inputs[1:])


def decode_custom_loss(name: Any, inputs: Any, graph: Any, *, max_nodes: int) -> CustomLoss:
    """Check a ``create_custom_loss`` request's ``name``, ``inputs`` and ``graph`` and build the
    program; raises :class:`InvalidInputError` naming the first field or node that is refused."""
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
        raise InvalidInputError("name must be a printable string of 1 to 128 characters")
    loss_inputs = _decode_inputs(inputs)
    if not isinstance(graph, dict):
        raise InvalidInputError("graph must be an object with 'format' and 'nodes'")
    if graph.get("format", 1) != 1:
        raise InvalidInputError(f"graph.format {graph.get('format')!r} is not supported (expected 1)")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise InvalidInputError("graph.nodes must be a non-empty list")
    if len(nodes) > max_nodes:
        raise InvalidInputError(
            f"graph has {len(nodes)} nodes; this server runs custom losses of at most {max_nodes} "
            "nodes (--custom-loss-max-nodes)"
        )
    return _Decoder(name, loss_inputs).decode(nodes)


def _decode_inputs(inputs: Any) -> tuple[LossInput, ...]:
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInputError("inputs must be a non-empty list, logprobs first")
    if len(inputs) > MAX_INPUTS:
        raise InvalidInputError(f"inputs has {len(inputs)} entries; a custom loss takes at most {MAX_INPUTS}")
    out = []
    for i, x in enumerate(inputs):
        if not isinstance(x, dict) or not isinstance(x.get("name"), str) or x.get("rank") not in (0, 1, 2):
            raise InvalidInputError(f"inputs[{i}] must be {{'name': str, 'rank': 0, 1 or 2}}")
        if isinstance(x.get("rank"), bool) or not _INPUT_NAME.fullmatch(x["name"]):
            raise InvalidInputError(f"inputs[{i}] must have a lowercase identifier name and an integer rank")
        out.append(LossInput(x["name"], int(x["rank"])))
    if out[0].name != "logprobs":
        raise InvalidInputError(f"inputs[0] must be logprobs, got {out[0].name!r}")
    if out[0].rank == 0:
        raise InvalidInputError("inputs[0] (logprobs) has rank 1 ([T]) or 2 ([T, K]), not 0")
    names = [x.name for x in out]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"inputs names repeat: {names}")
    if "target_tokens" in names:
        raise InvalidInputError("inputs must not read target_tokens; logprobs already are the targets' logprobs")
    return tuple(out)


class _Decoder:
    def __init__(self, name: str, inputs: tuple[LossInput, ...]):
        self.name = name
        self.inputs = inputs
        self.index: dict[str, int] = {}  # node name -> value position
        self.steps: list[Step] = []
        self.output: tuple[Ref, dict[str, Ref]] | None = None

    def decode(self, nodes: list[Any]) -> CustomLoss:
        placeholders = 0
        for i, node in enumerate(nodes):
            where = f"graph.nodes[{i}]"
            if not isinstance(node, dict):
                raise InvalidInputError(f"{where} must be an object")
            op, name, target = node.get("op"), node.get("name"), node.get("target")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise InvalidInputError(f"{where}.name must be an identifier, got {name!r}")
            where = f"graph node {name!r}"
            if not isinstance(target, str) or len(target) > 256:
                raise InvalidInputError(f"{where}: target must be a string")
            if name in self.index:
                raise InvalidInputError(f"{where}: the name is used by an earlier node")
            if self.output is not None:
                raise InvalidInputError(f"{where} comes after the output node")
            args, kwargs = node.get("args", []), node.get("kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise InvalidInputError(f"{where}: args must be a list and kwargs an object")
            if op == "placeholder":
                if self.steps:
                    raise InvalidInputError(f"{where}: placeholders must come before every call")
                if placeholders >= len(self.inputs) or target != self.inputs[placeholders].name:
                    expected = [x.name for x in self.inputs]
                    raise InvalidInputError(
                        f"{where}: placeholder {target!r} does not match inputs {expected} in order"
                    )
                if args or kwargs:
                    raise InvalidInputError(f"{where}: a placeholder takes no default value")
                self.index[name] = placeholders
                placeholders += 1
            elif op in ("call_function", "call_method"):
                if placeholders != len(self.inputs):
                    missing = [x.name for x in self.inputs[placeholders:]]
                    raise InvalidInputError(f"{where}: inputs {missing} have no placeholder before it")
                self.steps.append(self._call(where, op, name, target, args, kwargs))
                self.index[name] = len(self.inputs) + len(self.steps) - 1
            elif op == "output":
                if len(args) != 1:
                    raise InvalidInputError(f"{where}: the output node takes one argument, (loss, metrics)")
                self.output = self._output(where, args[0])
            elif op in ("get_attr", "call_module"):
                raise InvalidInputError(
                    f"{where}: op {op!r} ({target!r}) is not allowed; a custom loss may only call torch "
                    "and math functions and Tensor methods on its inputs"
                )
            else:
                raise InvalidInputError(f"{where}: unknown op {op!r}")
        if self.output is None:
            raise InvalidInputError("graph has no output node")
        loss, metrics = self.output
        return CustomLoss(self.name, self.inputs, tuple(self.steps), loss, metrics)

    # ------------------------------------------------------------------------- calls
    def _call(self, where: str, op: str, name: str, target: str, args: list, kwargs: dict) -> Step:
        if op == "call_function" and target == allowed.GETATTR:
            if kwargs or len(args) != 2 or not isinstance(args[1], str) or args[1] not in allowed.TENSOR_ATTRIBUTES:
                shown = args[1] if len(args) == 2 else args
                raise InvalidInputError(
                    f"{where}: getattr of {shown!r} is not allowed; a custom loss may read only "
                    f"{sorted(allowed.TENSOR_ATTRIBUTES)} of a tensor"
                )
            return Step(name, "attribute", args[1], None, (self._arg(where, args[0], 0, [0]),), {})
        if op == "call_function":
            fn = allowed.FUNCTIONS.get(target)
            if fn is None:
                raise InvalidInputError(
                    f"{where}: call_function {target!r} is not allowed in a server-side custom loss "
                    "(see docs/losses.md for the functions it may call)"
                )
            kind = "function"
        else:
            fn = None
            kind = "method"
            if target not in allowed.METHODS:
                raise InvalidInputError(
                    f"{where}: call_method {target!r} is not allowed in a server-side custom loss "
                    "(see docs/losses.md for the Tensor methods it may call)"
                )
            if not args:
                raise InvalidInputError(f"{where}: call_method {target!r} needs the tensor it is called on")
        for key in kwargs:
            if not isinstance(key, str) or not _NAME.fullmatch(key):
                raise InvalidInputError(f"{where}: keyword {key!r} is not an identifier")
            if key == "out":
                raise InvalidInputError(f"{where}: the keyword 'out' is not allowed (it writes into another tensor)")
        budget = [0]
        dargs = tuple(self._arg(where, a, 0, budget) for a in args)
        dkwargs = {k: self._arg(where, v, 0, budget) for k, v in kwargs.items()}
        return Step(name, kind, target, fn, dargs, dkwargs)

    def _arg(self, where: str, a: Any, depth: int, budget: list[int]) -> Any:
        budget[0] += 1
        if budget[0] > MAX_ARG_ITEMS:
            raise InvalidInputError(f"{where}: arguments hold more than {MAX_ARG_ITEMS} values")
        if depth > MAX_ARG_DEPTH:
            raise InvalidInputError(f"{where}: arguments nest deeper than {MAX_ARG_DEPTH} levels")
        if a is None or isinstance(a, bool):
            return a
        if isinstance(a, int):
            if not INT64_MIN <= a <= INT64_MAX:
                raise InvalidInputError(f"{where}: integer argument {a} is outside the int64 range")
            return a
        if isinstance(a, float):
            return a
        if isinstance(a, str):
            if len(a) > MAX_STRING or not a.isprintable():
                raise InvalidInputError(f"{where}: string arguments are printable and at most {MAX_STRING} characters")
            return a
        if isinstance(a, list):
            return [self._arg(where, x, depth + 1, budget) for x in a]
        if not isinstance(a, dict) or len(a) != 1:
            raise InvalidInputError(f"{where}: argument {str(a)[:80]!r} is not an encoded value")
        (kind, v), = a.items()
        if kind == "ref":
            if not isinstance(v, str) or v not in self.index:
                raise InvalidInputError(f"{where}: refers to {v!r}, which is not an earlier node")
            return Ref(self.index[v])
        if kind == "tuple" and isinstance(v, list):
            return tuple(self._arg(where, x, depth + 1, budget) for x in v)
        if kind == "slice" and isinstance(v, list) and len(v) == 3:
            return SliceArg(*(self._arg(where, x, depth + 1, budget) for x in v))
        if kind == "ellipsis" and v is True:
            return Ellipsis
        if kind == "float" and v in ("inf", "-inf", "nan"):
            return float(v)
        if kind == "dtype" and v in allowed.DTYPES:
            return allowed.DTYPES[v]
        if kind == "device" and isinstance(v, str) and len(v) <= MAX_STRING:
            return DEVICE
        if kind == "layout" and v in allowed.LAYOUTS:
            return allowed.LAYOUTS[v]
        if kind == "memory_format" and v in allowed.MEMORY_FORMATS:
            return allowed.MEMORY_FORMATS[v]
        raise InvalidInputError(f"{where}: argument {{{kind!r}: {str(v)[:60]!r}}} is not allowed")

    # ------------------------------------------------------------------------- output
    def _output(self, where: str, out: Any) -> tuple[Ref, dict[str, Ref]]:
        items = out.get("tuple") if isinstance(out, dict) and set(out) == {"tuple"} else out
        if not isinstance(items, list) or len(items) != 2:
            raise InvalidInputError(f"{where}: the loss must return (loss, metrics)")
        loss, metrics = items
        loss_ref = self._node_ref(where, loss, "the loss")
        if not (isinstance(metrics, dict) and set(metrics) == {"dict"} and isinstance(metrics["dict"], dict)):
            raise InvalidInputError(f"{where}: metrics must be a dict of tensors")
        refs = {}
        for key, value in metrics["dict"].items():
            if not _METRIC_KEY.fullmatch(key):
                raise InvalidInputError(
                    f"{where}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean in lowercase"
                )
            refs[key] = self._node_ref(where, value, f"metric {key!r}")
        return loss_ref, refs

    def _node_ref(self, where: str, value: Any, what: str) -> Ref:
        ref = self._arg(where, value, 0, [0]) if isinstance(value, dict) else None
        if not isinstance(ref, Ref):
            raise InvalidInputError(f"{where}: {what} must be a tensor computed by the graph")
        return ref
