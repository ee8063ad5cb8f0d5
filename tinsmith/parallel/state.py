"""Adapter state between sharded ranks and full-size tensors, so checkpoints do not depend on
the tensor-parallel size.

A checkpoint always holds full shapes (as one process would save them): :func:`gather_full`
assembles them from every rank's shards (all ranks call it; each gets the full tensors), and
:func:`scatter_full` cuts full tensors back into this rank's shards (no communication: every
rank holds the full checkpoint). A state saved under TP=2 thus loads under TP=1 and the reverse.
Optimizer state tensors (``NAME.exp_avg``...) are sharded like the tensor ``NAME`` they belong
to; per-tensor step counts are held whole.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn

from tinsmith.parallel.comm import all_gather_cat
from tinsmith.parallel.group import TPGroup

# How one tensor is split: the dimension (rank r holds chunk r of it), or the dimension and an
# order of its rows (rank r holds ``full.index_select(dim, order.chunk(ranks)[r])``) where the
# ranks' shares are not contiguous blocks, or where some ranks hold the same rows.
Split = Union[int, tuple[int, torch.Tensor]]
ShardDims = dict[str, Split | None]  # tensor name -> how it is split over ranks (None: held whole)


def lora_shard_dims(model: nn.Module) -> ShardDims:
    """For every LoRA tensor name the model can carry, which dimension its shards split."""
    out: ShardDims = {}
    for name, layer in model.lora_targets(True, True, True):
        dims = layer.shard_dims() if hasattr(layer, "shard_dims") else (None, None)
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = dims
    return out


def _dim(key: str, dims: ShardDims) -> Split | None:
    if key in dims:
        return dims[key]
    base, _, suffix = key.rpartition(".")
    if suffix == "step" or base not in dims:
        return None
    return dims[base]


def gather_full(tensors: dict[str, torch.Tensor], dims: ShardDims, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Full-size copies of this rank's shards (every rank must call it with the same names)."""
    out = {}
    for k, t in tensors.items():
        split = _dim(k, dims)
        if split is None:
            out[k] = t.detach().clone()
            continue
        d, order = split if isinstance(split, tuple) else (split, None)
        joined = all_gather_cat(t.detach(), tp, d, f"gather of {k}")
        if order is None or tp.size == 1:
            out[k] = joined
            continue
        # The full tensor's rows from wherever a rank holds them (rows several ranks hold alike,
        # e.g. a shared key/value head's, are equal on each, so any copy will do).
        shape = list(joined.shape)
        shape[d] = int(order.max()) + 1
        out[k] = joined.new_empty(shape).index_copy_(d, order.to(joined.device), joined)
    return out


def scatter_full(tensors: dict[str, torch.Tensor], dims: ShardDims, tp: TPGroup) -> dict[str, torch.Tensor]:
    """This rank's shards of full-size tensors."""
    out = {}
    for k, t in tensors.items():
        split = _dim(k, dims)
        if split is None or tp.size == 1:
            out[k] = t
            continue
        d, order = split if isinstance(split, tuple) else (split, None)
        whole = t.shape[d] if order is None else int(order.max()) + 1
        if t.shape[d] % tp.size if order is None else t.shape[d] != whole:
            raise ValueError(f"{k} has {t.shape[d]} entries along dimension {d}, not divisible by {tp.size} ranks"
                             if order is None else f"{k} has {t.shape[d]} entries along dimension {d}, not {whole}")
        out[k] = (t.chunk(tp.size, dim=d)[tp.rank].clone() if order is None else
                  t.index_select(d, order.chunk(tp.size)[tp.rank].to(t.device)))
    return out
