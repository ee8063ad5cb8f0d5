"""Turn a list of sequences (from many requests and adapters) into micro-batches.

Layout rules, chosen for speed and for exactness:

* Sequences are sorted by length and cut into micro-batches bounded by a padded-token budget
  and a sequence budget, so rows in one micro-batch have similar lengths (little padding).
* Rows are right-padded: with causal attention real tokens never see padding, so no mask is
  needed and the fast ``is_causal`` SDPA path is used.
* Inside a micro-batch, rows are ordered by adapter slot, so each adapter's tokens are one
  contiguous segment and its LoRA matmul is a single slice.
* Forward-only sequences never share a micro-batch with sequences that need gradients, so
  they run without an autograd graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinsmith.models.lora import Segments


@dataclass(frozen=True)
class SequenceRef:
    """One datum to run: where it came from and what it needs."""

    request: Any  # which request it belongs to (any sortable key, e.g. (pass, index))
    datum: int  # index of the datum in that request
    slot: int | None  # adapter slot (None = base model / full fine-tune unit)
    length: int
    needs_grad: bool


@dataclass
class MicroBatch:
    rows: list[SequenceRef]  # in row order
    tokens: torch.Tensor  # (b, L) int64, right-padded
    positions: torch.Tensor  # (b, L)
    row_segments: Segments  # over the flattened b*L rows
    token_segments: Segments  # over the packed real tokens (row-major)
    token_offsets: list[int]  # start of each row's real tokens in the packed order, len b+1
    valid: torch.Tensor  # (b*L,) int64: flat indices of the real tokens, row-major (an index, not
    # a boolean mask: selecting with a mask reads its count back from the device, a host sync)
    needs_grad: bool

    @property
    def padded_tokens(self) -> int:
        return int(self.tokens.numel())


def plan_micro_batches(seqs: list[SequenceRef], max_tokens: int, max_seqs: int) -> list[list[SequenceRef]]:
    """Group sequences into micro-batches of at most ``max_tokens`` padded tokens and ``max_seqs`` rows.

    A single sequence longer than ``max_tokens`` gets a micro-batch of its own.
    """
    groups: list[list[SequenceRef]] = []
    for needs_grad in (True, False):
        part = sorted((s for s in seqs if s.needs_grad == needs_grad), key=lambda s: (s.length, s.request, s.datum))
        cur: list[SequenceRef] = []
        for s in part:
            # Sorted ascending, so the new sequence sets the padded width.
            if cur and ((len(cur) + 1) * s.length > max_tokens or len(cur) + 1 > max_seqs):
                groups.append(cur)
                cur = []
            cur.append(s)
        if cur:
            groups.append(cur)
    return groups


def _segments(slots: list[int | None], bounds: list[int]) -> Segments:
    """Contiguous (slot, start, end) runs given each row's slot and the row boundaries."""
    segs: Segments = []
    for i, slot in enumerate(slots):
        a, b = bounds[i], bounds[i + 1]
        if segs and segs[-1][0] == slot:
            segs[-1] = (slot, segs[-1][1], b)
        else:
            segs.append((slot, a, b))
    return segs


def build_micro_batch(rows: list[SequenceRef], token_arrays: list[np.ndarray], device: torch.device) -> MicroBatch:
    """Materialise one micro-batch. ``token_arrays[i]`` holds the tokens of ``rows[i]``."""
    order = sorted(range(len(rows)), key=lambda i: (-1 if rows[i].slot is None else rows[i].slot, i))
    rows = [rows[i] for i in order]
    arrays = [token_arrays[i] for i in order]
    b, L = len(rows), max(r.length for r in rows)
    tokens = np.zeros((b, L), dtype=np.int64)
    for i, a in enumerate(arrays):
        tokens[i, : len(a)] = a
    lengths = np.array([r.length for r in rows])
    valid = np.arange(L)[None, :] < lengths[:, None]
    slots = [r.slot for r in rows]
    token_offsets = [0, *np.cumsum(lengths).tolist()]
    row_bounds = [i * L for i in range(b + 1)]
    return MicroBatch(
        rows=rows,
        tokens=torch.from_numpy(tokens).to(device),
        positions=torch.arange(L, device=device).unsqueeze(0).expand(b, L),
        row_segments=_segments(slots, row_bounds),
        token_segments=_segments(slots, token_offsets),
        token_offsets=token_offsets,
        valid=torch.from_numpy(np.flatnonzero(valid)).to(device),
        needs_grad=rows[0].needs_grad,
    )
