"""K/V in pages: every attention layer's K/V in one pool of fixed-size pages, a page table per row.

The per-row cache (:class:`tinsmith.sampling.kv_cache.RowKVCache`) gives every row the longest
row's capacity: rows of mixed lengths (RL batches, where a few long prompts or answers sit among
short ones) hold memory they never fill, the K/V budget admits fewer rows than it could, and
growing the capacity reallocates and copies the whole cache. Here, as in vLLM's PagedAttention,
a layer's K/V is a pool ``(pages, kv_heads, PAGE, head_dim)`` and row ``r``'s positions
``[j * PAGE, (j + 1) * PAGE)`` sit in page ``table[r, j]``:

- a row holds the pages its own positions need, taken before each decode burst
  (:meth:`PagedKVCache.reserve`) and given back when it leaves; the pool grows (doubling, within
  the budget) only when the free pages run out, and shrinks back when the sampler is idle;
- a finished row's place is taken by the last row by moving its page-table row: no K/V is copied;
- the table has a column for every position the model's context allows, so its address never
  changes as rows grow: a CUDA graph of the decode step stays valid however long rows become
  (graphs are kept per span, see :mod:`tinsmith.sampling.decode_graphs`);
- admission counts each row at its own positions (:meth:`PagedKVCache.bytes_for`), not every row
  at the longest one's;
- the prefix cache keeps prompts' full pages as its blocks (:mod:`tinsmith.sampling.prefix_cache`):
  a page is free once neither a row nor the prefix cache holds it, and when the free pages run
  out with the pool at its budget the prefix cache gives up its least recently used pages
  (``reclaim``) before the pool grows past it.

Page 0 is scratch: no row or prefix block ever holds it. Rows that hold nothing point at it, and
the padding rows of a fixed-shape step write their K/V there (one plain write per layer, like the
live rows'; nothing reads it but those padding rows, whose outputs are dropped). Sliding-window layers keep their per-row rings and hybrid models
their per-row recurrent states (both fixed per row); only full-attention layers are paged.

On a GPU the decode kernels (:mod:`tinsmith.kernels.decode_attention`) read the pages through the
table. Elsewhere a step gathers each row's pages into a row buffer first, which costs a copy per
layer and step: on a CPU the per-row cache is the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from tinsmith.kernels import kv_store
from tinsmith.models.config import ModelConfig

from tinsmith.sampling.kv_cache import BLOCK, KVTally, RowKVCache, RowNeed, StepRows, needs_of
from tinsmith.transfers import to_device

PAGE = BLOCK  # positions per page (a multiple of the decode kernels' block)
SCRATCH = 0  # the page padding rows write to and free rows point at (see the module's docstring)


class PagedKVCache(RowKVCache):
    page = PAGE

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int = 8,
                 max_bytes: int = 0, table_rows: int = 256):
        """``table_rows``: rows the page table and lengths hold from the start (the sampler's most
        rows): they then never move, and neither do CUDA graphs' addresses as the batch grows."""
        self.paged = [cfg.window_of(i) is None and not cfg.is_linear_layer(i) for i in range(cfg.num_layers)]
        self.width = -(-cfg.max_position_embeddings // PAGE)  # table columns: the longest row's pages
        self.cfg, self.dtype, self.max_bytes = cfg, dtype, max_bytes  # what sizing the pool reads
        self.pages = self._pool_within(1 + max(1, rows))  # the scratch page, and a page per row to start with
        super().__init__(cfg, device, dtype, rows, max_bytes)
        table_rows = max(table_rows, self.row_capacity)
        self.lengths = torch.zeros(table_rows, dtype=torch.long, device=device)
        self.table = torch.zeros(table_rows, self.width, dtype=torch.int32, device=device)
        self.owned: list[list[int]] = [[] for _ in range(table_rows)]  # pages per row, in order
        self.free: list[int] = list(range(self.pages - 1, SCRATCH, -1))  # popped from the end: low ids first
        # Rows holding each page (a prompt's full pages are shared); the scratch page is held for good.
        self.refs = [1] + [0] * (self.pages - 1)
        self._initial_pages = self.pages
        # Prompts' K/V noted by write_prefix, stored at the end of writes_together.
        self._pending: _PageWrites | None = None
        # Set by a prefix cache keeping its blocks in these pages: evict its least recently used
        # block (False: it holds none), and follow pages that a shrink moved (old id -> new id).
        self.reclaim: Callable[[], bool] | None = None
        self.on_remap: Callable[[dict[int, int]], None] | None = None
        # Bytes of a row's per-row buffers (rings beside the pages), by its positions up to the
        # longest ring: admission asks for every row at every burst.
        self._longest_ring = max([r for r in self.rings if r is not None], default=0)
        self._ring_bytes: dict[int, int] = {}

    # ----------------------------------------------------------------------------- layout
    def rowwise(self, layer: int) -> bool:
        return not self.paged[layer]

    def _shape(self, layer: int, rows: int, capacity: int) -> tuple[int, int, int, int]:
        if self.paged[layer]:
            return (self.pages, self.cfg.num_kv_heads, PAGE, self.cfg.head_dim)
        return super()._shape(layer, rows, capacity)

    def _rows_within(self, rows: int, capacity: int) -> int:
        """Rows cost only their per-row buffers here (rings, recurrent states): pages come as used."""
        if not self.max_bytes:
            return rows
        return max(1, min(rows, self.max_bytes // max(1, self.row_bytes(capacity, only=self.rowwise))))

    def page_bytes(self) -> int:
        """Bytes one page takes over every paged layer (K and V)."""
        width = torch.finfo(self.dtype).bits // 8
        return sum(2 * self.cfg.num_kv_heads * PAGE * self.cfg.head_dim * width for p in self.paged if p)

    def _pool_within(self, pages: int) -> int:
        """A pool of ``pages`` (the scratch page counted), or fewer (at least the scratch page and one
        more) where the budget holds fewer pages for rows: the scratch page is beside the budget."""
        if not self.max_bytes:
            return pages
        return max(2, min(pages, 1 + self.max_bytes // max(1, self.page_bytes())))

    def tally(self, rows: Sequence[RowNeed | int] = ()) -> PageTally:
        """Each row at its own positions in whole pages: a page some rows hold (``RowNeed.pages``)
        once, the other full pages of a group's shared prompt once for the group; per-row buffers
        (rings) for every row (see :class:`PageTally`)."""
        return PageTally(self, rows)

    def held_pages(self, row: int) -> tuple[int, ...]:
        return tuple(self.owned[row])

    def ring_bytes(self, positions: int) -> int:
        """Bytes of the per-row buffers (sliding-window rings) of a row of ``positions``."""
        key = min(positions, self._longest_ring)
        found = self._ring_bytes.get(key)
        if found is None:
            found = self._ring_bytes[key] = self.row_bytes(key, only=self.rowwise) if key else 0
        return found

    def static_bytes(self, rows: Sequence[RowNeed | int], bucket: int, capacity: int) -> int:
        """The live rows as :meth:`bytes_for` counts them; padding rows own no page (only per-row buffers)."""
        return self.bytes_for(rows) + (bucket - len(rows)) * self.row_bytes(capacity, only=self.rowwise)

    def bytes_at_most(self, positions: Sequence[int]) -> int:
        """Every row's pages counted as its own (sharing only lowers :meth:`bytes_for`), and its
        per-row buffers."""
        pages = sum(-(-p // PAGE) for p in positions)
        rings = sum(self.ring_bytes(p) for p in positions) if self._longest_ring else 0
        return pages * self.page_bytes() + rings

    def static_bytes_at_most(self, positions: Sequence[int], bucket: int, capacity: int) -> int:
        return self.bytes_at_most(positions) + (bucket - len(positions)) * self.row_bytes(capacity, only=self.rowwise)

    def used_bytes(self, rows: int) -> int:
        """The pages some row holds (a shared page once; pages only the prefix cache holds are its
        bytes), and the live rows' per-row buffers."""
        in_use = len({page for pages in list(self.owned) for page in list(pages)})
        return in_use * self.page_bytes() + rows * self.row_bytes(self.capacity, only=self.rowwise)

    def addresses(self) -> tuple:
        return (*super().addresses(), self.table.data_ptr())

    # ----------------------------------------------------------------------------- pages
    def reserve(self, spans: list[int]) -> None:
        """Give row ``i`` the pages to hold ``spans[i]`` positions (one table write for all)."""
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        # The pool grows once for the whole burst (each reallocation copies the pool and makes
        # captured graphs recapture), rather than doubling again and again as rows take pages.
        self._make_free(sum(max(0, -(-span // PAGE) - len(self.owned[r])) for r, span in enumerate(spans)))
        for r, span in enumerate(spans):
            self._reserve_row(r, span, rows, cols, pages)
        self._write_table(rows, cols, pages)

    def _reserve_row(self, row: int, span: int, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """Take the pages row ``row`` lacks for ``span`` positions; note the table entries to write."""
        need = -(-span // PAGE)
        assert need <= self.width, f"row {row} would hold {span} positions, past the model's context"
        have = self.owned[row]
        for j in range(len(have), need):
            page = self._take()
            have.append(page)
            rows.append(row)
            cols.append(j)
            pages.append(page)

    def _write_table(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        if pages:
            at = to_device(np.array([rows, cols, pages], dtype=np.int64), self.device)  # one copy, no wait
            self.table[at[0], at[1]] = at[2].to(torch.int32)

    def _take(self) -> int:
        self._make_free(1)
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def _make_free(self, n: int) -> None:
        """At least ``n`` free pages: the prefix cache's least recently used pages given up where the
        pool is at its budget, then the pool grown (see :meth:`_grow_pool`)."""
        if len(self.free) >= n:
            return
        if self.reclaim is not None:
            room = self._pool_within(self.pages + n) - self.pages  # pages the budget still lets the pool grow by
            while len(self.free) + room < n and self.reclaim():  # cached prompt pages go before the budget is passed
                pass
        if len(self.free) < n:
            self._grow_pool(n - len(self.free))

    def _grow_pool(self, short: int = 1) -> None:
        """Grow the pool by ``short`` pages or more: to twice its size where the budget holds that
        (by at least ``short`` pages whatever the budget), every paged layer's K/V reallocated,
        pages keeping their ids."""
        self._resize_pool(max(self.pages + short, self._pool_within(2 * self.pages)))

    def _resize_pool(self, pages: int, keep: list[int] | None = None) -> None:
        """Reallocate every paged layer's pool to ``pages`` pages, keeping pages ``[0, pages)``'s
        contents, or (``keep``) those of pages ``keep``, moved to ids ``0, 1, ...``."""
        kept = list(range(min(pages, self.pages))) if keep is None else keep
        at = to_device(kept, self.device, torch.long)
        for store in (self.K, self.V):
            for i, old in enumerate(store):
                if self.paged[i]:
                    new = torch.zeros((pages, *old.shape[1:]), device=self.device, dtype=self.dtype)
                    new[: len(kept)] = old[at]
                    store[i] = new
        if pages > self.pages:  # the new, higher ids are taken last
            self.free[:0] = range(pages - 1, self.pages - 1, -1)
        self.refs = self.refs[:pages] + [0] * (pages - len(self.refs))
        self.pages = pages

    def hold(self, pages: list[int]) -> None:
        """Keep ``pages`` (a prompt's shared pages) alive while rows are still to be written with
        them, whatever happens to the rows holding them meanwhile; :meth:`let_go` ends it."""
        for page in pages:
            self.refs[page] += 1

    def let_go(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if not self.refs[page]:
                self.free.append(page)

    def _release(self, row: int) -> None:
        """Row ``row`` lets go of its pages (those no other row holds go back to the free list);
        its table row points at the scratch page."""
        if self.owned[row]:
            self.let_go(self.owned[row][::-1])
            self.owned[row] = []
            self.table[row].fill_(0)

    # ----------------------------------------------------------------------------- rows
    def _rows_resized(self, keep: int, rows: int) -> None:
        """The table and lengths keep their place while they hold ``rows`` (they are made for the
        sampler's most rows); past that they grow, and only then move."""
        for r in range(keep, len(self.owned)):
            self._release(r)  # rows past the kept ones are not live: nothing of theirs is kept
        self.lengths[keep:].zero_()
        if rows <= self.table.shape[0]:
            return
        table = torch.zeros(rows, self.width, dtype=torch.int32, device=self.device)
        table[:keep] = self.table[:keep]
        self.table = table
        super()._rows_resized(keep, rows)
        self.owned = self.owned[:keep] + [[] for _ in range(rows - keep)]

    def shrink(self, live_rows: int, max_len: int) -> None:
        """As :meth:`RowKVCache.shrink`; once no row holds a page, a pool much larger than what is
        still held (the prefix cache's pages) is reallocated at that size, those pages moved to
        its first ids."""
        super().shrink(live_rows, max_len)
        if any(self.owned):
            return
        held = [p for p in range(self.pages) if self.refs[p]]  # the scratch page first: it keeps id 0
        size = max(self._initial_pages, len(held))
        if self.pages <= 4 * size:
            return
        refs = [self.refs[p] for p in held]
        self.free, self.refs = [], []
        self.pages = 0
        self._resize_pool(size, keep=held)
        self.refs[: len(held)] = refs
        self.free = [p for p in self.free if p >= len(held)]
        if held and self.on_remap is not None:
            self.on_remap({old: new for new, old in enumerate(held)})

    def read_pages(self, out: torch.Tensor, pages: list[int]) -> None:
        """Copy pages ``pages`` of every paged layer into ``out`` ``(attention layers, 2, kv_heads,
        len(pages) * PAGE, head_dim)`` (a prefill's layout: attention layers in order), the
        positions they hold in order; layers in per-row buffers are left as they are."""
        at = to_device(pages, self.device, torch.long)
        attention = [i for i in range(self.cfg.num_layers) if not self.cfg.is_linear_layer(i)]
        for j, layer in enumerate(attention):
            if self.paged[layer]:
                for kv, pool in enumerate((self.K[layer], self.V[layer])):
                    x = pool[at]  # (pages, heads, PAGE, d)
                    out[j, kv] = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])

    def write_prefix(self, rows, layer_kv, length, states=None, prompt=0, shared=None) -> list[int]:
        """As :meth:`RowKVCache.write_prefix`; ``shared``: full pages of the prompt that rows hold
        already (the prefix cache's). Every row holds those, and the first row's own full pages
        after them; each row owns the rest (its partial last page, which decoding appends to):
        full prompt pages are never written again, and ``num_samples`` rows (or requests of one
        prompt) keep one copy. Every page written is written for all rows by one store per layer,
        and within :meth:`writes_together` for every prompt written in it."""
        full = length // PAGE
        shared = list(shared or [])[:full]
        with self.writes_together():
            w = self._pending
            assert w is not None
            for row in rows:
                self._release(row)  # a row is written whole: whatever it held is stale
                for j, page in enumerate(shared):
                    self.refs[page] += 1
                    w.table[0].append(row)
                    w.table[1].append(j)
                    w.table[2].append(page)
                self.owned[row] = list(shared)
                self._reserve_row(row, length, *w.table)
                own = self.owned[row][len(shared): -(-length // PAGE)]
                w.positions(own, len(shared), length)
                shared = self.owned[row][:full]  # the rows after it hold its full pages too
            super().write_prefix(rows, layer_kv, length, states, prompt)
            w.prompt_done()
        return shared

    @contextmanager
    def writes_together(self) -> Iterator[None]:
        """Prompts' K/V written by :meth:`write_prefix` within this are stored at its end, all
        together: their full-attention layers' pages by one store per layer for K and one for V,
        their rows' page-table entries and lengths by one write each. Written one prompt at a
        time, every prompt cost a store per layer for K and V, each a launch: an admission of 256
        prompts on 28 layers launched 14,336 of them while the decoding rows waited, where it now
        launches about 112 (``bench/dispatch_micro.py --prefill``). Nothing must read the rows
        before the end, nor give their pages to another row (the sampler retires rows that end at
        once after it). Nested uses store at the outermost one's end; where the block raises,
        nothing of it is stored (its rows are dropped)."""
        if self._pending is not None:
            yield
            return
        self._pending = writes = _PageWrites()
        try:
            yield
        finally:
            self._pending = None
        writes.store(self)

    def _set_lengths(self, rows: range, length: int) -> None:
        if self._pending is None:
            super()._set_lengths(rows, length)
        else:
            self._pending.lengths += [(row, length) for row in rows]

    def _write_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        assert self._pending is not None, "a paged layer's K/V are written through write_prefix"
        self._pending.sources.setdefault(layer, []).append((k, v, self._pending.runs))

    def keep_rows(self, rows: int, order: list[int], upto: int | None = None) -> None:
        """As :meth:`RowKVCache.keep_rows`: the rows that leave let go of their pages (those no
        other row holds go back to the free list); the table rows of those that move go with
        them, and the table rows left behind point at the scratch page."""
        kept = set(order)
        for r in range(rows):
            if r not in kept and self.owned[r]:
                self.let_go(self.owned[r][::-1])
        owned = [self.owned[r] for r in order]
        self.owned[:rows] = owned + [[] for _ in range(rows - len(order))]
        moves = [(dst, src) for dst, src in enumerate(order) if dst != src]
        if moves:
            dst, src = to_device(np.array(moves, dtype=np.int64).T.copy(), self.device)
            self.table[dst] = self.table[src]
        if rows > len(order):
            self.table[len(order):rows] = SCRATCH
        super().keep_rows(rows, order, upto)

    # ----------------------------------------------------------------------------- decode steps
    def _write_step(self, layer, r, k, v, step) -> None:
        if not self.paged[layer]:
            return super()._write_step(layer, r, k, v, step)
        page, at = r.slots()
        K, V, k, v = self.K[layer], self.V[layer], k[:, :, 0], v[:, :, 0]
        if kv_store.usable(k, K) and kv_store.usable(v, V) and kv_store.store(K, V, k, v, page, at):
            return  # both in one kernel (GPUs)
        K[page, :, at] = k
        V[page, :, at] = v

    def _step_rows(self, n, live, rope):
        # Each row's page and offset for this step's keys and values are the same for every paged
        # layer: worked out with the rest, once a step.
        paged = any(self.paged)
        return StepRows(self.lengths, n, live, rope, self.table[:n] if paged else None, PAGE, SCRATCH)

    def _store_targets(self, r, step):
        first = next((i for i, paged in enumerate(self.paged) if paged), None)
        if first is None or not kv_store.usable(self.K[first], self.V[first]):
            return None  # no pages; or the K/V store kernel does not run here, nor a kernel that stores for it

        def target(layer: int) -> tuple[torch.Tensor, ...] | None:
            if not self.paged[layer]:
                return None  # a layer in per-row buffers (a ring)
            return (self.K[layer], self.V[layer], *r.slots())

        return target

    def _rows_view(self, layer: int, n: int, span: int, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[0, n)``'s pages gathered into row buffers (the torch path; the kernels read pages)."""
        if not self.paged[layer]:
            return super()._rows_view(layer, n, span, step)
        if "pages" not in step:
            step["pages"] = self.table[:n, : -(-span // PAGE)].long()
        pages = step["pages"]
        out = []
        for pool in (self.K[layer], self.V[layer]):
            x = pool[pages]  # (n, pages, heads, PAGE, d)
            out.append(x.transpose(1, 2).reshape(n, x.shape[2], -1, x.shape[-1])[:, :, :span])
        return out[0], out[1]

    def _pages(self, layer: int, n: int) -> torch.Tensor | None:
        return self.table[:n] if self.paged[layer] else None


class _PageWrites:
    """Prompts' K/V waiting for :meth:`PagedKVCache.writes_together`'s end: the page and offset
    of every position written, each paged layer's sources (a prompt's K and V with the runs of
    its positions they give, in the order of the positions), the table entries, the lengths."""

    def __init__(self) -> None:
        self.table: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.lengths: list[tuple[int, int]] = []
        self.pages: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.sources: dict[int, list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]]] = {}
        self.runs: list[tuple[int, int]] = []  # the prompt being written: its runs of positions

    def positions(self, dst: list[int], first: int, length: int) -> None:
        """Pages ``dst`` take the prompt's pages ``first, first + 1, ...``: positions from
        ``first * PAGE`` up to ``length`` (a partial last page: the positions it has)."""
        if not dst:
            return
        a, b = first * PAGE, min((first + len(dst)) * PAGE, length)
        if self.runs and self.runs[-1][1] == a:
            self.runs[-1] = (self.runs[-1][0], b)
        else:
            self.runs.append((a, b))
        self.pages.append(np.repeat(np.asarray(dst, dtype=np.int64), PAGE)[: b - a])
        self.offsets.append(np.arange(b - a, dtype=np.int64) % PAGE)

    def prompt_done(self) -> None:
        self.runs = []

    def store(self, cache: PagedKVCache) -> None:
        """Everything noted, into ``cache``: one host-to-device copy of the positions' pages and
        offsets, then per paged layer the prompts' K (and V) side by side (one copy where several
        runs) and one indexed store into its pool."""
        if self.table[2]:
            cache._write_table(*self.table)
        if self.lengths:
            at = to_device(np.array(self.lengths, dtype=np.int64).T, cache.device)
            cache.lengths[at[0]] = at[1]
        if not self.pages:
            return
        at = to_device(np.stack([np.concatenate(self.pages), np.concatenate(self.offsets)]), cache.device)
        for layer, written in self.sources.items():
            for pool, which in ((cache.K[layer], 0), (cache.V[layer], 1)):
                parts = [src[which][:, a:b] for *src, runs in written for a, b in runs]
                x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (heads, positions, d)
                assert x.shape[1] == at.shape[1], "every paged layer writes the same positions"
                pool[at[0], :, at[1]] = (x if x.dtype == pool.dtype else x.to(pool.dtype)).transpose(0, 1)


class PageTally(KVTally):
    """:class:`KVTally` for pages. A row's positions take whole pages: those it holds or will hold
    (``pages``: a running row's, a prompt's prefix-cache hits), counted once however many rows
    hold them; then the rest of its prompt's full pages, once per group; then its own pages."""

    cache: PagedKVCache

    def __init__(self, cache: PagedKVCache, needs: Sequence[RowNeed | int] = ()):
        self.own = 0  # pages of single rows
        self.groups: dict = {}  # group -> its shared full pages (beyond pages rows hold already)
        self.held: set[int] = set()  # pages rows hold or will hold
        self.per_row = 0  # bytes of per-row buffers
        super().__init__(cache, needs)

    @staticmethod
    def _pages(need: RowNeed) -> tuple[int, int]:
        """(own pages, the group's shared full pages) of ``need`` beyond the pages it names."""
        named = len(need.pages)
        full = max(0, need.shared // PAGE - named) if need.group is not None else 0
        return max(0, -(-need.positions // PAGE) - named - full), full

    def add(self, needs: Sequence[RowNeed | int]) -> None:
        for need in needs_of(needs):
            self.rows += 1
            own, full = self._pages(need)
            self.own += own
            if full:
                self.groups[need.group] = max(self.groups.get(need.group, 0), full)
            self.held.update(need.pages)
            self.per_row += self.cache.ring_bytes(need.positions)

    def bytes(self, more: Sequence[RowNeed | int] = ()) -> int:
        own, per_row = self.own, self.per_row
        grown: dict = {}  # groups of ``more`` whose shared pages pass what is counted
        held: set[int] = set()  # pages ``more`` names that no counted row holds
        for need in needs_of(more):
            mine, full = self._pages(need)
            own += mine
            if full > max(self.groups.get(need.group, 0), grown.get(need.group, 0)):
                grown[need.group] = full
            held.update(p for p in need.pages if p not in self.held)
            per_row += self.cache.ring_bytes(need.positions)
        shared = sum(self.groups.values()) + sum(full - self.groups.get(g, 0) for g, full in grown.items())
        return (own + shared + len(self.held) + len(held)) * self.cache.page_bytes() + per_row
