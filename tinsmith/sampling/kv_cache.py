"""KV cache for continuous batching: one row per live sequence, grown in blocks.

Each layer keeps ``K, V`` of shape ``(rows, kv_heads, capacity, head_dim)``. Capacity grows in
blocks of ``BLOCK`` positions as the longest live sequence grows (never reserved for the
maximum length up front), and rows are kept dense: when a sequence finishes, the last live row
moves into its place, so a decode step always runs over rows ``[0, n)``.

Sliding-window layers (gpt-oss: every other layer sees its last 128 positions) keep only a ring
of ``RING`` = the window rounded up to a block: position ``p`` lives at ``p % RING``, and a
decode step sees the ring's positions within the window of its own. Until a row outgrows the
ring, its positions sit in order as in any layer; the ring never grows past it, so such a layer
holds a fixed amount per row however long the sequence.

Hybrid models (Qwen3.5) hold K/V only for their attention layers (the Gated DeltaNet layers'
buffers have zero heads) and keep each row's fixed-size recurrent state beside them in
:class:`tinsmith.sampling.recurrent_state.RowRecurrentState`, which moves with the row.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
from torch.nn import functional as F

from tinsmith.kernels import decode_attention as decode_kernels
from tinsmith.kernels import step_rows
from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import masked_attention
from tinsmith.sampling.recurrent_state import DecodeStates, PrefillStates, RowRecurrentState
from tinsmith.transfers import to_device

BLOCK = 64


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


class RowNeed(NamedTuple):
    """What admission counts a row at: ``positions``, of which the first ``shared`` (its prompt)
    rows of the same ``group`` (one prompt's rows, seeded together) may hold as one copy.
    ``pages``: pages of a paged cache the row holds (a running row) or will hold (a prompt's
    prefix-cache hits) for its first positions; any other row holding one of them shares it."""

    positions: int
    group: Hashable | None = None
    shared: int = 0
    pages: tuple[int, ...] = ()


def needs_of(rows: Sequence[RowNeed | int]) -> list[RowNeed]:
    return [RowNeed(r) if isinstance(r, int) else r for r in rows]


class KVTally:
    """The bytes of K/V some rows take, as :meth:`RowKVCache.bytes_for` counts them, kept as rows
    are added: admission weighs each waiting request against the rows counted so far without
    counting those again (per-row buffers: every row at the longest one's positions)."""

    def __init__(self, cache: RowKVCache, needs: Sequence[RowNeed | int] = ()):
        self.cache = cache
        self.rows = 0
        self.longest = 0
        self.add(needs)

    def add(self, needs: Sequence[RowNeed | int]) -> None:
        for need in needs_of(needs):
            self.rows += 1
            self.longest = max(self.longest, need.positions)

    def bytes(self, more: Sequence[RowNeed | int] = ()) -> int:
        """Bytes of the rows counted, and of ``more`` beside them (not added)."""
        more = needs_of(more)
        rows = self.rows + len(more)
        longest = max([self.longest] + [n.positions for n in more])
        return rows * self.cache.row_bytes(_round_up(longest, BLOCK)) if rows else 0


class StepRows:
    """Rows ``[0, n)`` of one decode step and what its layers read of them, worked out once a step.

    ``pos`` (n,): the position each row decodes at, its cache length (0 for a padding row, whose
    ``live`` mark is 0); ``positions``: ``pos`` plus the rows' rotary offsets where given (what the
    step's rotary reads), else None. :meth:`slots`: where a paged cache's step keys and values go
    (page and offset), given ``table`` (pages per row) and ``page_size``. Where the kernel of
    :mod:`tinsmith.kernels.step_rows` runs (a GPU), one launch computes all of these; elsewhere
    torch ops compute each when first asked, and the torch paths' row indices and padding mask
    (:meth:`rows`, :meth:`keep`) only where a torch write asks for them.
    """

    def __init__(self, lengths: torch.Tensor, n: int, live: torch.Tensor | None = None,
                 rope: torch.Tensor | None = None, table: torch.Tensor | None = None, page_size: int = 1,
                 scratch: int = 0):
        self.n, self.live, self.device = n, live, lengths.device
        self.table, self.page_size, self.scratch = table, page_size, scratch
        self._rows: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None
        done = (step_rows.compute(lengths, n, live, rope, table, page_size, scratch)
                if step_rows.usable(lengths) else None)
        if done is not None:
            self.pos, self._seen, self.positions = done.pos, done.seen, done.positions
            self._slots = None if table is None else (done.page, done.at)
            return
        self.pos = lengths[:n] if live is None else lengths[:n] * live
        self._seen = None
        self.positions = None if rope is None else rope + self.pos
        self._slots = None

    def seen(self) -> torch.Tensor:
        """(n,) the keys each row's attention reads this step: ``pos + 1``."""
        if self._seen is None:
            self._seen = self.pos + 1
        return self._seen

    def rows(self) -> torch.Tensor:
        """(n,) ``0..n-1``: the rows' indices, for torch's indexed writes."""
        if self._rows is None:
            self._rows = torch.arange(self.n, device=self.device)
        return self._rows

    def keep(self) -> torch.Tensor | None:
        """(n, 1, 1) bool: False for a padding row (its write leaves the cache as it was); None
        when every row is live."""
        if self.live is None:
            return None
        if self._keep is None:
            self._keep = self.live.bool()[:, None, None]
        return self._keep

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (page, offset) for this step's keys and values in a paged cache (padding
        rows: the scratch page's first offset)."""
        if self._slots is None:
            assert self.table is not None, "the rows of a cache without pages have no page slots"
            page = self.table[self.rows(), self.pos // self.page_size].long()
            keep = self.keep()
            if keep is not None:  # padding rows write to the scratch page (their tables point there too)
                page = torch.where(keep.view(-1), page, self.scratch)
            self._slots = (page, self.pos % self.page_size)
        return self._slots


class RowKVCache:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int = 8,
                 max_bytes: int = 0):
        self.cfg = cfg
        self.max_bytes = max_bytes  # growth in rows stays within it where it can (0: no bound)
        self.device, self.dtype = device, dtype
        # per layer: the ring a sliding-window layer keeps (positions), None for every other layer
        self.rings = [None if cfg.window_of(i) is None else _round_up(cfg.window_of(i), BLOCK)
                      for i in range(cfg.num_layers)]
        self.capacity = BLOCK
        rows = self._rows_within(rows, BLOCK)
        self.row_capacity = rows
        self.K = [torch.zeros(self._shape(i, rows, self.capacity), device=device, dtype=dtype)
                  for i in range(cfg.num_layers)]
        self.V = [torch.zeros(self._shape(i, rows, self.capacity), device=device, dtype=dtype)
                  for i in range(cfg.num_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens held per row
        self.recurrent = RowRecurrentState(cfg, device, dtype, rows) if cfg.has_recurrent_state else None

    def _heads(self, layer: int) -> int:
        return 0 if self.cfg.is_linear_layer(layer) else self.cfg.num_kv_heads  # no K/V in DeltaNet layers

    def slots(self, layer: int, capacity: int) -> int:
        """Positions layer ``layer`` keeps per row when rows hold ``capacity``: all, or its ring."""
        ring = self.rings[layer]
        return capacity if ring is None else min(capacity, ring)

    def _shape(self, layer: int, rows: int, capacity: int) -> tuple[int, int, int, int]:
        return (rows, self._heads(layer), self.slots(layer, capacity), self.cfg.head_dim)

    def row_bytes(self, capacity: int, only: Callable[[int], bool] | None = None) -> int:
        """Bytes of K/V one row of ``capacity`` positions takes (sliding-window layers: their ring);
        ``only``: of the layers it accepts."""
        width = torch.finfo(self.dtype).bits // 8
        return sum(2 * self._heads(i) * self.slots(i, capacity) * self.cfg.head_dim * width
                   for i in range(self.cfg.num_layers) if only is None or only(i))

    def _rows_within(self, rows: int, capacity: int) -> int:
        """``rows``, or fewer (at least 1) where ``max_bytes`` holds fewer rows of ``capacity`` positions:
        spare rows are never allocated beyond the budget."""
        if not self.max_bytes:
            return rows
        return max(1, min(rows, self.max_bytes // max(1, self.row_bytes(capacity))))

    def rowwise(self, layer: int) -> bool:
        """Whether ``layer``'s K/V live in per-row buffers (here every layer's; see
        :class:`tinsmith.sampling.paged_kv_cache.PagedKVCache` for pages)."""
        return True

    def bytes_for(self, rows: Sequence[RowNeed | int]) -> int:
        """Bytes of K/V that ``rows`` (positions each, or :class:`RowNeed`) take: every row at the
        longest one's (per-row buffers share nothing)."""
        return self.tally(rows).bytes()

    def tally(self, rows: Sequence[RowNeed | int] = ()) -> KVTally:
        """A running count of what rows take, starting from ``rows`` (see :class:`KVTally`)."""
        return KVTally(self, rows)

    def bytes_at_most(self, positions: Sequence[int]) -> int:
        """At least :meth:`bytes_for` of rows at ``positions``, whatever pages or prompts they
        share, from the positions alone: the decode loop's budget checks run it every burst and
        count exactly (a tally over every row's pages) only when it passes the budget. Per-row
        buffers share nothing: exact."""
        return len(positions) * self.row_bytes(_round_up(max(positions), BLOCK)) if positions else 0

    def held_pages(self, row: int) -> tuple[int, ...]:
        """The pages row ``row`` holds (per-row buffers: none)."""
        return ()

    def static_bytes(self, rows: Sequence[RowNeed | int], bucket: int, capacity: int) -> int:
        """Bytes of K/V a fixed-shape step of ``bucket`` rows (the live ``rows``, then padding) at
        ``capacity`` positions takes: every row, padding included, at the capacity."""
        return bucket * self.row_bytes(capacity)

    def static_bytes_at_most(self, positions: Sequence[int], bucket: int, capacity: int) -> int:
        """At least :meth:`static_bytes` of live rows at ``positions`` (see :meth:`bytes_at_most`)."""
        return bucket * self.row_bytes(capacity)

    def reserve(self, spans: list[int]) -> None:
        """Room for row ``i`` to hold ``spans[i]`` positions. Per-row buffers have it once
        :meth:`ensure` sized them for the longest."""

    def addresses(self) -> tuple:
        """Where the buffers a decode step reads and writes sit (a captured step holds them)."""
        states = () if self.recurrent is None else (*self.recurrent.conv.values(), *self.recurrent.state.values())
        return (self.lengths.data_ptr(), *(t.data_ptr() for t in (*self.K, *self.V, *states)))

    def used_bytes(self, rows: int) -> int:
        """Bytes of K/V that ``rows`` live rows hold (for metrics): here a whole row buffer each."""
        return rows * self.row_bytes(self.capacity)

    def nbytes(self) -> int:
        """Bytes the cache's buffers take (for metrics; its lists may be swapped meanwhile, a copy is read)."""
        recurrent = self.recurrent.nbytes() if self.recurrent is not None else 0
        return sum(t.numel() * t.element_size() for t in list(self.K) + list(self.V)) + recurrent

    # ----------------------------------------------------------------------------- sizing
    def ensure(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` positions (grows geometrically / by blocks).

        ``length`` covers every live row. When more rows would not fit ``max_bytes`` at the
        current capacity (left long by a longer sequence that has finished), the capacity comes
        down to ``length``: the positions past it hold nothing.
        """
        if rows <= self.row_capacity and length <= self.capacity:
            return
        new_cap = self.capacity if length <= self.capacity else _round_up(max(length, self.capacity + BLOCK), BLOCK)
        if rows > self.row_capacity and self._rows_within(rows, new_cap) < rows:
            new_cap = _round_up(length, BLOCK)
        new_rows = self.row_capacity if rows <= self.row_capacity else max(rows, 2 * self.row_capacity)
        new_rows = max(rows, self._rows_within(new_rows, new_cap))  # spare rows only within the budget
        keep = min(new_rows, self.row_capacity)  # rows are dense: those past ``rows`` hold nothing
        for store in (self.K, self.V):
            for i, old in enumerate(store):
                shape = self._shape(i, new_rows, new_cap)
                if not self.rowwise(i) or shape == old.shape:  # a ring the rows had already outgrown
                    continue
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                # In order up to the smaller of the two; a ring that wrapped is kept whole (its size
                # does not change once rows outgrow it, and rows that did keep it).
                width = min(self.slots(i, new_cap), self.slots(i, self.capacity))
                new[:keep, :, :width] = old[:keep, :, :width]
                store[i] = new
        if new_rows != self.row_capacity:
            if self.recurrent is not None:
                self.recurrent.resize(new_rows)
            self._rows_resized(keep, new_rows)
        self.row_capacity, self.capacity = new_rows, new_cap

    def _rows_resized(self, keep: int, rows: int) -> None:
        """The per-row lengths (and a subclass's per-row bookkeeping) follow the buffers to ``rows``
        rows, the first ``keep`` kept."""
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        lengths[:keep] = self.lengths[:keep]
        self.lengths = lengths

    def shrink(self, live_rows: int, max_len: int) -> None:
        """Give memory back when the batch has become much smaller than the buffers."""
        if self.capacity > 4 * _round_up(max_len, BLOCK) or self.row_capacity > 4 * max(live_rows, 8):
            cap = _round_up(max(max_len, 1), BLOCK)
            rows = min(max(live_rows, 1, self._rows_within(max(8, 2 * live_rows), cap)), self.row_capacity)
            for store in (self.K, self.V):
                for i, old in enumerate(store):
                    if self.rowwise(i):
                        store[i] = old[:rows, :, :self.slots(i, cap)].clone()
            if self.recurrent is not None:
                self.recurrent.resize(rows)
            self._rows_resized(rows, rows)
            self.row_capacity, self.capacity = rows, cap

    # ----------------------------------------------------------------------------- rows
    def write_prefix(self, rows: range, layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]], length: int,
                     states: PrefillStates | None = None, prompt: int = 0, shared: object = None) -> object:
        """Copy a prefilled prompt's K/V ``(kv_heads, length, head_dim)`` per attention layer into
        every row of ``rows`` (rows of the same prompt: its samples, or requests of it admitted
        together), one copy per layer for all of them, and on hybrid models prompt ``prompt``'s
        recurrent states of the prefill.

        Returns what later rows of the same prompt may pass as ``shared`` to hold the prompt's
        K/V without a copy of their own (per-row buffers copy every row: None)."""
        at = slice(rows.start, rows.stop)
        for i, (k, v) in layer_kv.items():
            ring = self.rings[i]
            if not self.rowwise(i):
                self._write_pages(i, k, v, length)
            elif ring is None or length <= ring:
                self.K[i][at, :, :length] = k[:, :length]
                self.V[i][at, :, :length] = v[:, :length]
            else:  # a sliding-window layer keeps the prompt's last ``ring`` positions, each at p % ring
                pos = torch.arange(length - ring, length, device=self.device) % ring
                self.K[i][at][:, :, pos] = k[:, length - ring:length]
                self.V[i][at][:, :, pos] = v[:, length - ring:length]
        if self.recurrent is not None:
            assert states is not None, "a hybrid model's prefill records its recurrent states"
            for row in rows:
                self.recurrent.write_row(row, states, prompt)
        self._set_lengths(rows, length)

    def _set_lengths(self, rows: range, length: int) -> None:
        """Rows ``rows`` hold ``length`` positions now."""
        self.lengths[rows.start:rows.stop] = length

    def hold(self, shared: object) -> None:
        """Keep what :meth:`write_prefix` returned valid for later rows (per-row buffers: nothing to keep)."""

    def let_go(self, shared: object) -> None:
        """End a :meth:`hold`."""

    def prefill_states(self, lengths: torch.Tensor, width: int, after: PrefillStates | None = None
                       ) -> PrefillStates | None:
        """Where a prefill of prompts of ``lengths`` (right-padded to ``width``) records its
        recurrent states (None: the model has none); ``after``: the states it continues from."""
        if self.recurrent is None:
            return None
        return PrefillStates(lengths, width, self.recurrent.kernel, after)

    def keep_rows(self, rows: int, order: list[int], upto: int | None = None) -> None:
        """Of rows ``[0, rows)``, rows ``[0, len(order))`` become rows ``order`` (each kept once,
        in that order); the others leave (finished). One gather and one store per buffer for all the rows that
        move, however many finish at once. ``upto``: at least the positions a moving row holds,
        known on the host (the sampler's count); positions past a row's length are copied too,
        harmlessly. Without it the whole capacity is copied: lengths are never read back (a read
        is a wait for the device)."""
        moves = [(dst, src) for dst, src in enumerate(order) if dst != src]
        if not moves:
            return
        dst, src = to_device(np.array(moves, dtype=np.int64).T.copy(), self.device)  # one copy, no wait
        width = self.capacity if upto is None else min(upto, self.capacity)
        for store in (self.K, self.V):
            for i, t in enumerate(store):
                if self.rowwise(i):
                    t[dst, :, :width] = t[src, :, :width]  # a ring: all of it, once the row has outgrown it
        if self.recurrent is not None:
            self.recurrent.move_rows(src, dst)
        self.lengths[dst] = self.lengths[src]  # on the device

    # ----------------------------------------------------------------------------- attention
    def decode_attention(self, n: int, span: int, live: torch.Tensor | None = None, rope: torch.Tensor | None = None):
        """Attention backend for one decode step over rows ``[0, n)``.

        Writes each row's new K/V at its current length, then attends over the row's
        ``length + 1`` positions; ``span`` is the longest of those (the caller has it already,
        from sizing the cache for this step). Grouped-query heads are folded into the query dimension, so
        cached K/V are never repeated.

        ``live`` (n,) 0/1 marks padding rows of a fixed-shape step (0): they sit at position 0
        and write back what the cache holds there, so the step leaves their rows (free, or
        filled by something else meanwhile) as they were. ``rope`` (n,) int64: the rows' rotary
        offsets; the backend's ``positions`` is then each row's position plus its offset, what the
        step's rotary reads (worked out with the rest of the rows' bookkeeping: :class:`StepRows`).
        """
        r = self._step_rows(n, live, rope)
        pos = r.pos
        # The masks of the torch path, built once per step for all layers, and only when a layer
        # takes that path (the decode kernels need none).
        masks: dict[str, torch.Tensor] = {}

        def future() -> torch.Tensor:
            if "future" not in masks:
                masks["future"] = torch.arange(span, device=self.device)[None, :] > pos[:, None]  # (n, span)
            return masks["future"]

        def additive_mask() -> torch.Tensor:
            # 0 / -inf: SDPA takes it faster than a boolean one.
            if "additive" not in masks:
                masks["additive"] = torch.zeros((n, span), dtype=self.dtype, device=self.device).masked_fill_(
                    future(), float("-inf"))[:, None, None, :]
            return masks["additive"]

        visible: dict[int | None, torch.Tensor] = {}  # window -> (n, 1, keys) keys each row sees
        step: dict = {}  # what a subclass computes once per step for all its layers
        # On a GPU the kernels of tinsmith.kernels.decode_attention read only each row's own
        # positions: per ring size (None: no ring), how many leading slots each row sees.
        kernels = decode_kernels.usable(self.K[0])
        seen_slots: dict[int | None, torch.Tensor] = {}

        def kernel_attention(layer: int, q: torch.Tensor, ring: int | None, window: int | None,
                             sinks: torch.Tensor | None) -> torch.Tensor | None:
            # A ring as long as its window is seen whole once written: its first min(p + 1, ring)
            # slots, in whatever order (a softmax does not care). A longer ring needs the mask.
            if not kernels or ring != window:
                return None
            if ring not in seen_slots:
                seen_slots[ring] = r.seen() if ring is None else torch.clamp(r.seen(), max=ring)
            keys = span if ring is None else min(span, ring)
            return decode_kernels.try_decode_attention(q, self.K[layer], self.V[layer], seen_slots[ring], keys, sinks,
                                                       table=self._pages(layer, n))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   sinks: torch.Tensor | None = None, window: int | None = None, stored: bool = False) -> torch.Tensor:
            ring = self.rings[layer]
            if not stored:  # else the layer wrote k and v where store_target said (its norm's kernel)
                self._write_step(layer, r, k, v, step)
            out = kernel_attention(layer, q, ring, window, sinks)
            if out is not None:
                return out
            K, V = self.K[layer], self.V[layer]
            if ring is not None:
                # The ring's slot s holds the row's latest position p - d with d = (p - s) mod ring:
                # seen when within the window (d < window) and written (p - d >= 0).
                keys = min(span, K.shape[2])
                if window not in visible:
                    d = (pos[:, None] - torch.arange(keys, device=self.device)[None, :]) % ring
                    visible[window] = ((d < window) & (d <= pos[:, None]))[:, None]
                return masked_attention(q, K[:n, :, :keys], V[:n, :, :keys], visible[window], sinks)
            K, V = self._rows_view(layer, n, span, step)
            if sinks is not None or window is not None:
                if window not in visible:
                    seen = ~future() if window is None else ~future() & (
                        torch.arange(span, device=self.device)[None, :] > pos[:, None] - window)
                    visible[window] = seen[:, None]
                return masked_attention(q, K, V, visible[window], sinks)
            hq, hk = q.shape[1], k.shape[1]
            rep = hq // hk
            qg = q.reshape(n, hk, rep, q.shape[-1])  # (n, kv_heads, rep, d): rep queries per kv head
            out = F.scaled_dot_product_attention(qg, K, V, attn_mask=additive_mask())
            return out.reshape(n, hq, 1, q.shape[-1])

        states = None if self.recurrent is None else DecodeStates(self.recurrent, n, live)
        attend.recurrent = states  # type: ignore[attr-defined]
        # Where a layer's step keys and values go, for a kernel of the layer that writes them itself.
        attend.store_target = self._store_targets(r, step)  # type: ignore[attr-defined]
        attend.positions = r.positions  # type: ignore[attr-defined]
        return attend

    def _step_rows(self, n: int, live: torch.Tensor | None, rope: torch.Tensor | None) -> StepRows:
        """Rows ``[0, n)``'s bookkeeping for a decode step (a paged cache adds its pages)."""
        return StepRows(self.lengths, n, live, rope)

    def _write_step(self, layer: int, r: StepRows, k: torch.Tensor, v: torch.Tensor, step: dict) -> None:
        """Store a decode step's K/V (n, kv_heads, 1, d) of rows ``r`` at their positions (a ring's
        slot ``pos % ring``); a padding row (``r.keep()`` False) writes back what was there."""
        K, V = self.K[layer], self.V[layer]
        ring = self.rings[layer]
        rows, keep = r.rows(), r.keep()
        at = r.pos if ring is None else r.pos % ring
        if keep is None:
            K[rows, :, at] = k[:, :, 0]
            V[rows, :, at] = v[:, :, 0]
        else:
            K[rows, :, at] = torch.where(keep, k[:, :, 0], K[rows, :, at])
            V[rows, :, at] = torch.where(keep, v[:, :, 0], V[rows, :, at])

    def _store_targets(self, r: StepRows, step: dict) -> Callable[[int], tuple[torch.Tensor, ...] | None] | None:
        """For a kernel of a layer that writes the step's keys and values itself: a function of the
        layer giving ``(K, V, page, at)``, where :meth:`_write_step` would put them
        (``K[page[r], :, at[r]]``), or None for that layer; None for every layer of this step
        (asked once a step, so that a layer pays nothing where no kernel can). Per-row buffers: None
        (they write padding rows back as they were, not one plain write)."""
        return None

    def _rows_view(self, layer: int, n: int, span: int, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K, V of rows ``[0, n)``, positions ``[0, span)``: (n, kv_heads, span, d)."""
        return self.K[layer][:n, :, :span], self.V[layer][:n, :, :span]

    def _pages(self, layer: int, n: int) -> torch.Tensor | None:
        """The page table of rows ``[0, n)`` for a layer kept in pages (None: per-row buffers)."""
        return None

    def _write_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        raise NotImplementedError("per-row buffers hold every layer")

    @contextmanager
    def writes_together(self) -> Iterator[None]:
        """Prompts' K/V that :meth:`write_prefix` puts into the cache within this are stored by its
        end (a paged cache stores them all together: see :meth:`PagedKVCache.writes_together`);
        per-row buffers store each at once. Nothing reads the rows written before the end."""
        yield


def recording_attention(store: dict[int, tuple[torch.Tensor, torch.Tensor]], states: PrefillStates | None = None):
    """Causal attention for a prefill that also keeps every attention layer's K/V (after rotary)
    and, on hybrid models, every Gated DeltaNet layer's final states in ``states``."""
    from tinsmith.models.layers import causal_attention

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        store[layer] = (k, v)
        return causal_attention(layer, q, k, v, sinks=sinks, window=window)

    attend.recurrent = states  # type: ignore[attr-defined]
    return attend
