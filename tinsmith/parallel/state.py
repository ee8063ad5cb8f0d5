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


def split_of(key: str, dims: ShardDims) -> Split | None:
    """How the tensor ``key`` (or the optimizer state ``NAME.exp_avg``... of one) is split over ranks."""
    if key in dims:
        return dims[key]
    base, _, suffix = key.rpartition(".")
    if suffix == "step" or base not in dims:
        return None
    return dims[base]


def gather_full(tensors: dict[str, torch.Tensor], dims: ShardDims, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Full-size copies of this rank's shards (every rank must call it with the same names)."""
    out = {k: t.detach().clone() for k, t in tensors.items() if split_of(k, dims) is None}
    split = [k for k in tensors if split_of(k, dims) is not None]
    out.update(zip(split, gather_splits([tensors[k] for k in split], [split_of(k, dims) for k in split], tp)))
    return {k: out[k] for k in tensors}


# Shards gathered by one all-gather, at most this many bytes at full size: a few collectives for a
# whole adapter (one per tensor was hundreds), without a second full copy of a large state at once.
GATHER_BUCKET_BYTES = 64 << 20


def gather_splits(shards: list[torch.Tensor], splits: list[Split], tp: TPGroup) -> list[torch.Tensor]:
    """Full-size tensors from this rank's ``shards``, each split as ``splits`` says, in as few
    all-gathers as :data:`GATHER_BUCKET_BYTES` allows (every rank must pass shards of the same
    shapes, dtypes and splits in the same order)."""
    out: list[torch.Tensor | None] = [None] * len(shards)
    if tp.size == 1:
        return [t.detach().clone() for t in shards]
    bucket: list[int] = []
    size = 0
    for i, t in enumerate(shards):
        if bucket and (t.dtype != shards[bucket[0]].dtype or size + t.nbytes * tp.size > GATHER_BUCKET_BYTES):
            _gather_bucket(shards, splits, bucket, out, tp)
            bucket, size = [], 0
        bucket.append(i)
        size += t.nbytes * tp.size
    if bucket:
        _gather_bucket(shards, splits, bucket, out, tp)
    return out  # type: ignore[return-value]


def _gather_bucket(shards: list[torch.Tensor], splits: list[Split], bucket: list[int],
                   out: list[torch.Tensor | None], tp: TPGroup) -> None:
    flat = torch.cat([shards[i].detach().reshape(-1) for i in bucket])
    every = all_gather_cat(flat, tp, 0, f"gather of {len(bucket)} sharded tensors").view(tp.size, -1)
    at = 0
    for i in bucket:
        t, split = shards[i], splits[i]
        pieces = every[:, at : at + t.numel()].reshape(tp.size, *t.shape)
        at += t.numel()
        d, order = split if isinstance(split, tuple) else (split, None)
        joined = torch.cat(list(pieces.unbind(0)), dim=d)
        if order is None:
            out[i] = joined
            continue
        # The full tensor's rows from wherever a rank holds them (rows several ranks hold alike,
        # e.g. a shared key/value head's, are equal on each, so any copy will do).
        shape = list(joined.shape)
        shape[d] = int(order.max()) + 1
        out[i] = joined.new_empty(shape).index_copy_(d, order.to(joined.device), joined)


def scatter_full(tensors: dict[str, torch.Tensor], dims: ShardDims, tp: TPGroup) -> dict[str, torch.Tensor]:
    """This rank's shards of full-size tensors."""
    out = {}
    for k, t in tensors.items():
        split = split_of(k, dims)
        if split is None or tp.size == 1:
            out[k] = t
            continue
        d, order = split if isinstance(split, tuple) else (split, None)
        whole = t.shape[d] if order is None else int(order.max()) + 1
        if t.shape[d] % tp.size if order is None else t.shape[d] != whole:
            raise ValueError(f"{k} has {t.shape[d]} entries along dimension {d}, not divisible by {tp.size} ranks"
                             if order is None else f"{k} has {t.shape[d]} entries along dimension {d}, not {whole}")
        out[k] = own_part(t, split, tp)
    return out


def own_part(full: torch.Tensor, split: Split, tp: TPGroup) -> torch.Tensor:
    """This rank's shard of the full-size tensor ``full``, split as ``split`` says (a copy)."""
    d, order = split if isinstance(split, tuple) else (split, None)
    if order is None:
        return full.chunk(tp.size, dim=d)[tp.rank].clone()
    return full.index_select(d, order.chunk(tp.size)[tp.rank].to(full.device))
