"""Every tenant's LoRA in a training micro-batch as a few large products, not a pair per tenant.

A multi-tenant micro-batch lays each adapter's rows out contiguously. Run adapter by adapter,
each projection costs two small matmuls per tenant, forward and backward, launched one by one
(measured on an H100: 4,657 matmul launches in a four-tenant step, the CPU issuing them for 815
ms against 335 ms of GPU work, 0.54x the speed of one tenant). Here the adapters' ``A`` and ``B``
are stacked for the step (ranks zero-padded to a common width, the scale folded into ``B``), and
either

- **dense** (:func:`dense_lora_add`): the shrink is one product of the rows with every
  adapter's stacked ``A`` (rows x adapters*rank), each row's columns of other adapters zeroed,
  then the expand one product with every adapter's stacked ``B`` added into the base output in
  the same GEMM (as one tenant's ``addmm``). Each row pays the other adapters' rank in FLOPs,
  little while adapters x rank is small, and no separate add pass over the output; or
- **grouped** (:func:`grouped_lora_delta`): ``torch._grouped_mm`` runs each half for all adapters
  at once, each group at its own rank, then the delta is added to the base output.

Autograd carries the gradients back through the stack to each adapter's own tensors, so
optimizer state and isolation are as before. Padding adds nothing: padded rows of ``A`` and
columns of ``B`` are zero, and so are the masked columns, so they get zero outputs and zero
gradients (dropped by the slicing).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from tinsmith.transfers import to_device

if TYPE_CHECKING:
    from tinsmith.models.lora import LoraWeights


# How a training micro-batch's several adapters run: "dense", "grouped", "loop" (adapter by
# adapter), or "auto": on a GPU, grouped where the grouped matmul runs (Hopper), else dense while
# the stacked rank (adapters in the micro-batch x their padded rank) is at most DENSE_MAX_RANK;
# elsewhere (CPUs) the loop, unless the grouped matmul is forced (moe.GROUPED_MM). On an H200
# (Qwen3-1.7B shape, rank 32, 2 x 1024 tokens per tenant) grouped kept 0.895 of one tenant's
# speed with four tenants against dense's 0.616, and 0.695 against 0.581 with sixteen.
MULTI_LORA = "auto"
DENSE_MAX_RANK = 256


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=64)
def group_offsets(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The end row of each group (int32, on ``device``), what ``torch._grouped_mm`` takes.

    Every projection of a micro-batch has the same groups, so this is made once per micro-batch
    layout, not once per layer: one host-to-device copy instead of one per projection, forward
    and backward (the tensor is only read, so sharing it is safe).
    """
    return to_device(np.cumsum(sizes, dtype=np.int64).astype(np.int32), device)


def multi_lora_path(x: torch.Tensor, weights: list[LoraWeights | None], out_features: int) -> str | None:
    """How the row groups of ``x`` with ``weights`` (None: a group with no adapter) take their
    adapters: ``"dense"``, ``"grouped"``, or None for one adapter at a time (see :data:`MULTI_LORA`)."""
    present = [w for w in weights if w is not None]
    if len(present) < 2 or MULTI_LORA == "loop":
        return None
    if MULTI_LORA == "dense":
        return "dense"
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    if _grouped_fits(x, len(weights), rank, out_features):
        return "grouped"
    if MULTI_LORA == "auto" and x.is_cuda and len(weights) * rank <= DENSE_MAX_RANK:
        return "dense"
    return None


def _grouped_fits(x: torch.Tensor, groups: int, rank: int, out_features: int) -> bool:
    """Whether the grouped matmuls take ``groups`` adapters' shrink and expand at ``rank``: no more
    groups than one call takes, on a device whose grouped matmul kernel is fast (see
    :func:`tinsmith.models.moe.grouped_mm_usable`)."""
    from tinsmith.models import moe  # late: moe imports the LoRA layers that import this module

    return (groups <= moe.MAX_GROUPS and moe.grouped_mm_fits(x, x.dtype, rank, x.shape[-1])
            and moe.grouped_mm_fits(x, x.dtype, out_features, rank))


def grouped_lora_delta(x: torch.Tensor, weights: list[LoraWeights | None], sizes: list[int],
                       out_features: int) -> torch.Tensor:
    """``scale_i * x_i A_i^T B_i^T`` for consecutive row groups ``x_i`` of ``sizes`` (a group with
    no adapter gets zeros), as one (rows, out) tensor."""
    present = [w for w in weights if w is not None]
    A, B = stack_lora(weights, _round_up(max(w.A.shape[0] for w in present), 8), x.dtype, x.shape[-1], out_features)
    offs = group_offsets(tuple(sizes), x.device)
    h = torch._grouped_mm(x, A.transpose(1, 2), offs=offs)
    return torch._grouped_mm(h, B.transpose(1, 2), offs=offs)


def dense_lora_add(y: torch.Tensor, x: torch.Tensor, weights: list[LoraWeights | None], sizes: list[int],
                   out_features: int) -> torch.Tensor:
    """``y`` plus ``scale_i * x_i A_i^T B_i^T`` for consecutive row groups ``x_i`` of ``sizes`` (a
    group with no adapter adds nothing), as two products over every adapter's stacked factors:
    the rows times all the ``A`` (rows x adapters*rank), each row's other adapters' columns
    zeroed, then times all the ``B``, added into ``y`` by the same GEMM."""
    present = [w for w in weights if w is not None]
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    A, B = stack_lora(weights, rank, x.dtype, x.shape[-1], out_features, side_by_side=True)  # (G*r, in), (out, G*r)
    h = F.linear(x, A) * own_columns(tuple(sizes), rank, x.dtype, x.device)
    return torch.addmm(y, h, B.t())


@functools.lru_cache(maxsize=8)
def own_columns(sizes: tuple[int, ...], rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows, groups*rank) in ``dtype``: 1 where a row's column belongs to its own group's ``rank``
    columns, 0 elsewhere. Made once per micro-batch layout (every projection, forward and backward,
    shares it; only read), on the device, without a host wait."""
    groups = torch.arange(len(sizes), device=device)
    of_row = torch.repeat_interleave(groups, to_device(np.asarray(sizes, dtype=np.int64), device),
                                     output_size=sum(sizes))
    of_column = torch.arange(len(sizes) * rank, device=device) // rank
    return (of_row[:, None] == of_column[None, :]).to(dtype)


def stack_lora(weights: list[LoraWeights | None], rank: int, dtype: torch.dtype, in_features: int,
               out_features: int, groups: int = 1, side_by_side: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters' A and B stacked for one grouped shrink and expand: ``(adapters x groups, rank,
    in)`` and ``(adapters x groups, out, rank)`` in ``dtype``, ranks zero-padded to ``rank``, each
    adapter's scale folded into its B, an absent adapter's groups zeros. ``groups``: the stacked
    projections each adapter holds (its experts; 1 for a plain projection, whose A is ``(r, in)``).
    ``side_by_side`` (plain projections): for two dense products instead, ``(adapters x rank, in)``
    and ``(out, adapters x rank)``, each adapter's columns of B beside the others'.

    A few operations whatever the number of adapters (an adapter whose rank is ``rank`` is not
    copied before the stack): the stack, one cast each, and the scales. Gradients flow back
    through it to each adapter's own tensors."""
    present = [w for w in weights if w is not None]
    like = present[0].A
    a_parts, b_parts = [], []
    for w in weights:
        if w is None:
            a_parts.append(like.new_zeros(groups, rank, in_features))
            b_parts.append(like.new_zeros(groups, out_features, rank))
            continue
        a = w.A.to(like.dtype).reshape(groups, -1, in_features)
        b = w.B.to(like.dtype).reshape(groups, out_features, -1)
        pad = rank - a.shape[1]
        a_parts.append(F.pad(a, (0, 0, 0, pad)) if pad else a)
        b_parts.append(F.pad(b, (0, pad)) if pad else b)
    each = tuple(0.0 if w is None else float(w.scale) for w in weights)
    if side_by_side:
        scales = _group_scales(each, rank, like.dtype, like.device).reshape(1, -1)  # one per column of B
        return (torch.cat([a[0] for a in a_parts]).to(dtype),
                (torch.cat([b[0] for b in b_parts], dim=1) * scales).to(dtype))
    scales = _group_scales(each, groups, like.dtype, like.device)
    return torch.cat(a_parts).to(dtype), (torch.cat(b_parts) * scales).to(dtype)


@functools.lru_cache(maxsize=64)
def _group_scales(scales: tuple[float, ...], groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each adapter's scale for each of its ``groups``, ``(adapters x groups, 1, 1)`` (read only)."""
    return to_device(np.repeat(np.asarray(scales, dtype=np.float64), groups), device, dtype).reshape(-1, 1, 1)
