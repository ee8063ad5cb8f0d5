"""What a server-side custom loss may call: explicit allow-lists, nothing resolved from user text.

A custom loss arrives as a torch.fx graph written out as data (``tinker``'s ``encode_graph``):
each ``call_function`` node names its target by qualified name (``torch.exp``,
``operator.mul``, ``torch.nn.functional.log_softmax``), each ``call_method`` node names a
``torch.Tensor`` method. The server never looks a name up in a module: it looks it up in the
tables below, which map the exact wire names to callables chosen here.

What is on the lists: elementwise math, comparisons and logic, reductions, softmax-style
normalisations, shape and indexing operations, the common ``torch.nn.functional`` losses,
a few tensor factories whose sizes are checked before they allocate, and ``math`` functions
on Python numbers. What is not: anything that does I/O or reaches Python objects (``getattr``
only reads the attributes in :data:`TENSOR_ATTRIBUTES`), in-place methods (they could write into
logprobs shared with other requests), uninitialised memory (``empty``), random numbers,
``.item()``/``.tolist()``/``.numpy()``, and autograd calls.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name


def _wire_name(fn: Callable[..., Any]) -> str:
    """The name the SDK writes for ``fn`` (``encode_graph``: fx's qualified name, with CPython's
    private ``_operator`` module spelt ``operator``)."""
    name = _get_qualified_name(fn)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


_TORCH_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    # elementwise math
    torch.abs, torch.neg, torch.negative, torch.sign, torch.exp, torch.exp2, torch.expm1, torch.log,
    torch.log1p, torch.log2, torch.log10, torch.sqrt, torch.rsqrt, torch.square, torch.pow,
    torch.reciprocal, torch.sigmoid, torch.tanh, torch.relu, torch.erf, torch.erfc, torch.floor,
    torch.ceil, torch.round, torch.trunc, torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max,
    torch.minimum, torch.maximum, torch.fmin, torch.fmax, torch.where, torch.lerp, torch.xlogy,
    torch.logaddexp, torch.nan_to_num, torch.add, torch.sub, torch.subtract, torch.mul,
    torch.multiply, torch.div, torch.divide, torch.true_divide, torch.floor_divide,
    torch.remainder, torch.fmod, torch.special.expit, torch.special.xlogy, torch.special.log1p,
    torch.special.logit, torch.logit, torch.sin, torch.cos,
    # comparisons and logic
    torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne, torch.isnan, torch.isinf,
    torch.isfinite, torch.logical_and, torch.logical_or, torch.logical_not, torch.logical_xor,
    # reductions
    torch.sum, torch.mean, torch.nansum, torch.nanmean, torch.prod, torch.std, torch.var,
    torch.norm, torch.amax, torch.amin, torch.max, torch.min, torch.argmax, torch.argmin,
    torch.all, torch.any, torch.count_nonzero, torch.logsumexp, torch.cumsum, torch.cumprod,
    torch.softmax, torch.log_softmax, torch.topk, torch.sort, torch.argsort, torch.dot,
    torch.matmul,
    # shapes and indexing
    torch.stack, torch.cat, torch.concat, torch.squeeze, torch.unsqueeze, torch.flatten,
    torch.reshape, torch.transpose, torch.permute, torch.flip, torch.roll, torch.narrow,
    torch.select, torch.gather, torch.index_select, torch.masked_select, torch.masked_fill,
    torch.broadcast_to, torch.split, torch.chunk, torch.unbind, torch.nonzero, torch.tril,
    torch.triu,
    # factories (sizes checked before they allocate)
    torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace, torch.zeros_like,
    torch.ones_like, torch.full_like, torch.scalar_tensor,
    torch.cosine_similarity,
    # torch.nn.functional
    F.log_softmax, F.softmax, F.logsigmoid, F.softplus, F.relu, F.gelu, F.silu, F.elu,
    F.leaky_relu, F.sigmoid, F.tanh, F.normalize, F.kl_div, F.mse_loss, F.l1_loss,
    F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
    F.nll_loss, F.cross_entropy,
)

_OPERATOR_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.neg, operator.pos, operator.abs, operator.matmul, operator.getitem,
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, operator.and_,
    operator.or_, operator.xor, operator.invert,
)

_MATH_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    math.log, math.log1p, math.log2, math.log10, math.exp, math.expm1, math.sqrt, math.pow,
    math.floor, math.ceil, math.fabs, math.tanh, math.sin, math.cos, math.isfinite, math.isnan,
    math.isinf,
)

# Wire name -> callable, for call_function nodes.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    _wire_name(fn): fn for fn in _TORCH_FUNCTIONS + _OPERATOR_FUNCTIONS + _MATH_FUNCTIONS
}
# fx records attribute reads (``x.shape``) as calls to the builtin getattr.
GETATTR = "getattr"
TENSOR_ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "device", "T", "mT"})

# call_method nodes: Tensor methods, none in place, none leaving torch.
METHODS = frozenset({
    "abs", "neg", "sign", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "square", "pow", "reciprocal", "sigmoid", "tanh", "relu", "erf", "floor", "ceil", "round",
    "trunc", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "where", "lerp",
    "xlogy", "logaddexp", "nan_to_num", "add", "sub", "mul", "div", "true_divide", "floor_divide",
    "remainder", "fmod", "logit",
    "lt", "le", "gt", "ge", "eq", "ne", "isnan", "isinf", "isfinite", "logical_and", "logical_or",
    "logical_not", "logical_xor",
    "sum", "mean", "nansum", "nanmean", "prod", "std", "var", "norm", "amax", "amin", "max", "min",
    "argmax", "argmin", "all", "any", "count_nonzero", "logsumexp", "cumsum", "cumprod", "softmax",
    "log_softmax", "topk", "sort", "argsort", "dot", "matmul",
    "squeeze", "unsqueeze", "flatten", "reshape", "view", "view_as", "reshape_as", "transpose",
    "permute", "flip", "roll", "narrow", "select", "gather", "index_select", "masked_select",
    "masked_fill", "expand", "expand_as", "broadcast_to", "split", "chunk", "unbind", "nonzero",
    "contiguous", "clone", "detach", "tril", "triu", "t",
    "size", "dim", "numel", "float", "double", "half", "bfloat16", "long", "int", "bool", "to",
    "type_as", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like",
})

# Tensor-making calls that take no tensor whose device they could follow: they get the device
# the loss runs on.
FACTORIES = frozenset({
    "torch.zeros", "torch.ones", "torch.full", "torch.arange", "torch.linspace",
    "torch.scalar_tensor",
})

# Calls whose output is never larger than their tensor arguments broadcast together (or, where
# those do not broadcast, than the largest of them): elementwise math, reductions, views,
# conversions. Their size is checked by arithmetic on shapes; every other call on tensors is
# first run on meta tensors, which is exact but slower.
_BOUNDED_NAMES = (
    "abs", "neg", "negative", "sign", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt",
    "rsqrt", "square", "pow", "reciprocal", "sigmoid", "tanh", "relu", "erf", "erfc", "floor", "ceil",
    "round", "trunc", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "fmin", "fmax",
    "where", "lerp", "xlogy", "logaddexp", "nan_to_num", "add", "sub", "subtract", "mul", "multiply",
    "div", "divide", "true_divide", "floor_divide", "remainder", "fmod", "logit", "sin", "cos",
    "lt", "le", "gt", "ge", "eq", "ne", "isnan", "isinf", "isfinite", "logical_and", "logical_or",
    "logical_not", "logical_xor", "sum", "mean", "nansum", "nanmean", "prod", "std", "var", "norm",
    "amax", "amin", "max", "min", "argmax", "argmin", "all", "any", "count_nonzero", "logsumexp",
    "cumsum", "cumprod", "softmax", "log_softmax", "topk", "sort", "argsort", "squeeze", "unsqueeze",
    "flatten", "reshape", "view", "view_as", "reshape_as", "transpose", "permute", "flip", "roll",
    "narrow", "select", "gather", "masked_fill", "split", "chunk", "unbind", "contiguous", "clone",
    "detach", "tril", "triu", "t", "size", "dim", "numel", "float", "double", "half", "bfloat16", "long",
    "int", "bool", "to", "type_as", "zeros_like", "ones_like", "full_like", "invert", "and_", "or_",
    "xor", "truediv", "floordiv", "mod", "pos", "expit", "special_expit", "special_xlogy",
    "special_log1p", "special_logit", "log_sigmoid", "softplus", "gelu", "silu", "elu", "leaky_relu",
    "normalize", "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "nll_loss", "cross_entropy", "cosine_similarity",
)
BOUNDED_BY_INPUTS = frozenset(
    name for name in set(FUNCTIONS) | METHODS if name.rsplit(".", 1)[-1] in _BOUNDED_NAMES
)

# Calls that return a tuple of pieces: how many is checked before they run.
SPLITTING = frozenset({"torch.split", "split", "torch.chunk", "chunk", "torch.unbind", "unbind"})

# Calls whose output size depends on tensor values, so no shape check can run before them;
# their output is never larger than their input (boolean masks, nonzero indices).
DATA_DEPENDENT = frozenset({
    "operator.getitem", "torch.masked_select", "masked_select", "torch.nonzero", "nonzero",
})

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
LAYOUTS: dict[str, torch.layout] = {"strided": torch.strided}
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
}
