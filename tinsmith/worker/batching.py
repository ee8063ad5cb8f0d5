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

Packed layout (``packed=True``, for models that can run per document, see
``CausalLM.supports_packing``): the micro-batch is one row of the sequences laid end to end,
positions restarting at 0 for each, with ``doc_bounds`` for a document-causal attention
backend. Padding then costs nothing, and micro-batches are bounded by real tokens. Sequences
marked ``padded`` (a datum with images: an image-text model lays its multimodal positions and
image features out per row) never share a micro-batch with the others and run right-padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tinsmith.models.lora import Segments
from tinsmith.transfers import to_device


@dataclass(frozen=True)
class SequenceRef:
    """One datum to run: where it came from and what it needs."""

    request: Any  # which request it belongs to (any sortable key, e.g. (pass, index))
    datum: int  # index of the datum in that request
    slot: int | None  # adapter slot (None = base model / full fine-tune unit)
    length: int
    needs_grad: bool
    padded: bool = False  # must run in a right-padded row of its own, even when packing (images)


@dataclass
class MicroBatch:
    rows: list[SequenceRef]  # in row order
    tokens: torch.Tensor  # (b, L) int64, right-padded; packed: (1, T), the rows end to end
    positions: torch.Tensor  # (b, L)
    row_segments: Segments  # over the flattened b*L rows
    token_segments: Segments  # over the packed real tokens (row-major)
    token_offsets: list[int]  # start of each row's real tokens in the packed order, len b+1
    valid: torch.Tensor | None  # (b*L,) int64: flat indices of the real tokens, row-major (an index, not
    # a boolean mask: selecting with a mask reads its count back from the device, a host sync);
    # None when every position is real (packed)
    needs_grad: bool
    # Packed: the documents' bounds on the single row (cumulative lengths, ``cu_seqlens``); None: padded.
    doc_bounds: list[int] | None = None


def batch_tokens(rows: list[SequenceRef], packed: bool) -> int:
    """Tokens a micro-batch of ``rows`` computes: their sum packed, rows times the longest padded
    (as a micro-batch of ``padded`` sequences always is)."""
    if packed and not any(r.padded for r in rows):
        return sum(r.length for r in rows)
    return len(rows) * max(r.length for r in rows)


def plan_micro_batches(seqs: list[SequenceRef], max_tokens: int, max_seqs: int,
                       packed: bool = False) -> list[list[SequenceRef]]:
    """Group sequences into micro-batches of at most ``max_tokens`` tokens (padded, or real when
    ``packed``) and ``max_seqs`` sequences.

    A single sequence longer than ``max_tokens`` gets a micro-batch of its own. ``padded``
    sequences are grouped apart, by their padded size.
    """
    groups: list[list[SequenceRef]] = []
    for needs_grad, padded in ((True, False), (True, True), (False, False), (False, True)):
        part = sorted((s for s in seqs if s.needs_grad == needs_grad and s.padded == padded),
                      key=lambda s: (s.length, s.request, s.datum))
        cur: list[SequenceRef] = []
        size = 0  # tokens of ``cur`` with ``s`` added
        for s in part:
            # Sorted ascending, so the new sequence sets the padded width.
            size = size + s.length if packed and not padded else (len(cur) + 1) * s.length
            if cur and (size > max_tokens or len(cur) + 1 > max_seqs):
                groups.append(cur)
                cur, size = [], s.length
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


def build_micro_batch(rows: list[SequenceRef], token_arrays: list[np.ndarray], device: torch.device,
                      packed: bool = False) -> MicroBatch:
    """Materialise one micro-batch. ``token_arrays[i]`` holds the tokens of ``rows[i]``; packed
    unless asked not to or a row is ``padded``."""
    order = sorted(range(len(rows)), key=lambda i: (-1 if rows[i].slot is None else rows[i].slot, i))
    rows = [rows[i] for i in order]
    arrays = [token_arrays[i] for i in order]
    if packed and not any(r.padded for r in rows):
        return _packed_micro_batch(rows, arrays, device)
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
        tokens=to_device(tokens, device),
        positions=torch.arange(L, device=device).unsqueeze(0).expand(b, L),
        row_segments=_segments(slots, row_bounds),
        token_segments=_segments(slots, token_offsets),
        token_offsets=token_offsets,
        valid=to_device(np.flatnonzero(valid), device),
        needs_grad=rows[0].needs_grad,
    )


def _packed_micro_batch(rows: list[SequenceRef], arrays: list[np.ndarray], device: torch.device) -> MicroBatch:
    """One row of the sequences end to end: rows and real tokens coincide, so the row segments
    are the token segments and no valid-token index is needed."""
    lengths = [r.length for r in rows]
    bounds = [0, *np.cumsum(lengths).tolist()]
    positions = np.concatenate([np.arange(n) for n in lengths])
    segments = _segments([r.slot for r in rows], bounds)
    return MicroBatch(
        rows=rows,
        tokens=to_device(np.concatenate(arrays).astype(np.int64, copy=False), device).unsqueeze(0),
        positions=to_device(positions, device).unsqueeze(0),
        row_segments=segments,
        token_segments=segments,
        token_offsets=bounds,
        valid=None,
        needs_grad=rows[0].needs_grad,
        doc_bounds=bounds,
    )
