"""Linear layers that carry many LoRA adapters at once.

A batch is laid out so that all rows (tokens) of one adapter are contiguous; the caller
passes ``segments`` — ``(slot, start, end)`` triples over the flattened leading dimension —
and each layer runs one big base matmul plus one small ``x @ A.T @ B.T`` per segment.
Each adapter owns its own ``A`` (rank x in) and ``B`` (out x rank) tensors, sized to its own
rank, so optimizer state is sized to that rank and one adapter's update can never touch
another's weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# (adapter slot or None for "base model only", start row, end row) over the flattened rows.
Segments = list[tuple[int | None, int, int]]
# Inference-only alternative: (adapter slot, LongTensor of row indices) for rows that are not
# contiguous (a decode batch whose rows come and go); applied with an in-place index_add.
RowGroups = list[tuple[int, torch.Tensor]]


@dataclass
class LoraWeights:
    A: torch.Tensor  # (rank, in_features), trainable leaf
    B: torch.Tensor  # (out_features, rank), trainable leaf
    scale: float


class LoraLinear(nn.Module):
    """``y = x W^T (+ b) + sum over segments of scale * x A^T B^T`` (LoRA on selected rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.adapters: dict[int, LoraWeights] = {}

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        """Create adapter ``slot``: A ~ kaiming-uniform (as peft does), B = 0 so it starts as a no-op."""
        A = torch.empty(rank, self.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) bound
        A.uniform_(-bound, bound, generator=generator)
        B = torch.zeros(self.out_features, rank, dtype=torch.float32)
        device = self.weight.device
        w = LoraWeights(A.to(device).requires_grad_(), B.to(device).requires_grad_(), alpha / rank)
        self.adapters[slot] = w
        return w

    def remove_adapter(self, slot: int) -> None:
        self.adapters.pop(slot, None)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not segments or not self.adapters:
            return y
        if len(segments[0]) == 2:
            return self._forward_groups(x, y, segments)  # type: ignore[arg-type]
        shape = y.shape
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, shape[-1])
        active = [(self.adapters.get(s) if s is not None else None, a, b) for s, a, b in segments]
        if all(w is None for w, _, _ in active):
            return y
        if len(active) == 1:
            w, _, _ = active[0]
            return self._add_delta(y2, x2, w).reshape(shape)
        pieces = []
        for w, a, b in active:
            pieces.append(y2[a:b] if w is None else self._add_delta(y2[a:b], x2[a:b], w))
        return torch.cat(pieces, dim=0).reshape(shape)

    def _forward_groups(self, x: torch.Tensor, y: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        shape = y.shape
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1])
        for slot, rows in groups:
            w = self.adapters.get(slot)
            if w is None:  # never fall back to the base weights silently
                raise KeyError(f"LoRA adapter slot {slot} is not attached to this layer")
            y2.index_add_(0, rows, self._delta(x2.index_select(0, rows), w))
        return y2.reshape(shape)

    @staticmethod
    def _delta(x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
        A, B = w.A, w.B
        if A.dtype != x.dtype:
            A, B = A.to(x.dtype), B.to(x.dtype)
        return F.linear(F.linear(x, A), B) * w.scale

    @staticmethod
    def _add_delta(y: torch.Tensor, x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
        """``y + scale * (x A^T) B^T`` as one fused GEMM (scale and add in its epilogue)."""
        A, B = w.A, w.B
        if A.dtype != x.dtype:
            A, B = A.to(x.dtype), B.to(x.dtype)
        return torch.addmm(y, F.linear(x, A), B.t(), alpha=w.scale)

    def merged_weight(self, slot: int) -> torch.Tensor:
        """W + scale * B A for export (fp32)."""
        w = self.adapters[slot]
        return self.weight.float() + w.scale * (w.B.detach().float() @ w.A.detach().float())
