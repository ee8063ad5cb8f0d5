"""Every tenant's LoRA in a training micro-batch as one grouped shrink and one grouped expand.

A multi-tenant micro-batch lays each adapter's rows out contiguously. Run adapter by adapter,
each projection costs two small matmuls per tenant, forward and backward, launched one by one
(measured on an H100: 4,657 matmul launches in a four-tenant step, the CPU issuing them for 815
ms against 335 ms of GPU work, 0.54x the speed of one tenant). Here the adapters' ``A`` and ``B``
are stacked for the step (ranks zero-padded to a common width, the scale folded into ``B``) and
``torch._grouped_mm`` runs each half for all adapters at once; autograd carries the gradients
back through the stack to each adapter's own tensors, so optimizer state and isolation are as
before. Padding adds nothing: padded rows of ``A`` and columns of ``B`` are zero, so they get
zero outputs and their gradients are dropped by the slicing.
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


def grouped_lora_usable(x: torch.Tensor, weights: list[LoraWeights | None], out_features: int) -> bool:
    """Whether the grouped path runs for these rows: at least two adapters (and no more groups
    than one grouped matmul takes), on a device whose grouped matmul kernel is fast (see
    :func:`tinsmith.models.moe.grouped_mm_usable`)."""
    from tinsmith.models import moe  # late: moe imports the LoRA layers that import this module

    present = [w for w in weights if w is not None]
    if len(present) < 2 or len(weights) > moe.MAX_GROUPS:
        return False
    rank = _round_up(max(w.A.shape[0] for w in present), 8)
    return moe.grouped_mm_fits(x, x.dtype, rank, x.shape[-1]) and moe.grouped_mm_fits(x, x.dtype, out_features, rank)


def grouped_lora_delta(x: torch.Tensor, weights: list[LoraWeights | None], sizes: list[int],
                       out_features: int) -> torch.Tensor:
    """``scale_i * x_i A_i^T B_i^T`` for consecutive row groups ``x_i`` of ``sizes`` (a group with
    no adapter gets zeros), as one (rows, out) tensor."""
    present = [w for w in weights if w is not None]
    A, B = stack_lora(weights, _round_up(max(w.A.shape[0] for w in present), 8), x.dtype, x.shape[-1], out_features)
    offs = group_offsets(tuple(sizes), x.device)
    h = torch._grouped_mm(x, A.transpose(1, 2), offs=offs)
    return torch._grouped_mm(h, B.transpose(1, 2), offs=offs)


def stack_lora(weights: list[LoraWeights | None], rank: int, dtype: torch.dtype, in_features: int,
               out_features: int, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters' A and B stacked for one grouped shrink and expand: ``(adapters x groups, rank,
    in)`` and ``(adapters x groups, out, rank)`` in ``dtype``, ranks zero-padded to ``rank``, each
    adapter's scale folded into its B, an absent adapter's groups zeros. ``groups``: the stacked
    projections each adapter holds (its experts; 1 for a plain projection, whose A is ``(r, in)``).

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
    scales = _group_scales(tuple(0.0 if w is None else float(w.scale) for w in weights), groups, like.dtype, like.device)
    return torch.cat(a_parts).to(dtype), (torch.cat(b_parts) * scales).to(dtype)


@functools.lru_cache(maxsize=64)
def _group_scales(scales: tuple[float, ...], groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each adapter's scale for each of its ``groups``, ``(adapters x groups, 1, 1)`` (read only)."""
    return to_device(np.repeat(np.asarray(scales, dtype=np.float64), groups), device, dtype).reshape(-1, 1, 1)
