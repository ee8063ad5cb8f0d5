"""Prefix cache: prompts' K/V kept across requests, in fixed-size blocks, evicted least recently used.

RL programs send one prompt as many separate requests (GRPO: 16 per prompt) and multi-turn
prompts repeat every earlier turn; without this each request prefills its whole prompt again.

A block holds ``block`` consecutive prompt positions of every attention layer's K and V. Blocks
are keyed as a chain: ``(weights, parent block id, its tokens)``, so a block stands for its
whole prefix (the K/V of a position depend on every token before it) and a prompt reuses its
longest chain of cached blocks. Keys compare the tokens themselves (dict equality), never only
a hash, so a collision cannot hand one prompt another's K/V.

Where a block's K/V live depends on the sampler's K/V layout:

- per-row buffers (:class:`tinsmith.sampling.kv_cache.RowKVCache`): a block is a tensor of its
  own, ``(layers, 2, kv_heads, block, head_dim)``, cloned from a prefill; a hit is copied into
  the row's buffers;
- pages (:class:`tinsmith.sampling.paged_kv_cache.PagedKVCache`): a block *is* a page of the
  pool, ``block`` = the page size. The cache adopts the full prompt pages a row was written
  into (holding a reference on each), and a later row of a prompt starting with them holds
  the same pages: a hit neither copies K/V into the row nor keeps a second copy, as in vLLM's
  and SGLang's prefix caches. Layers kept in per-row buffers beside the pages (gpt-oss'
  sliding-window rings) keep their part of a block as a tensor. When the pool runs out of free
  pages within its budget it evicts blocks before it grows (:meth:`PrefixCache.reclaim`), and
  when it shrinks after a busy spell the blocks' pages move with it (:meth:`PrefixCache.remap`).

``weights`` names the weights that computed the K/V: the adapter slot (None: the model's own
weights) and that slot's version, which the model changes at every optimizer step, load or
new adapter (:meth:`CausalLM.weights_version`). A stale version is never looked up again; its
blocks age out.

Eviction keeps the chain whole: every lookup and insert touches a chain's blocks from the
last to the first, so a block is always used more recently than any block after it, and the
least recently used block is never the parent of a live one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

import torch

if TYPE_CHECKING:
    from tinsmith.sampling.paged_kv_cache import PagedKVCache

BLOCK = 16  # prompt positions per cached block: small enough that most of a shared prompt is reused
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass
class _Entry:
    id: int
    kv: torch.Tensor | None  # (layers, 2, kv_heads, block, head_dim): every layer, or those beside the pages
    page: int | None = None  # the pool page holding the paged layers' K/V


class PrefixCache:
    """K/V of prompt blocks under a byte budget (0: nothing is ever kept).

    ``pool``: the paged K/V cache whose pages hold the blocks (None: blocks are tensors of their
    own); ``rowwise``: then, the attention layers (indices into a block's first dimension, as a
    prefill lays them out) kept beside the pages, whose K/V a block keeps as a tensor."""

    def __init__(self, max_bytes: int, block: int = BLOCK, pool: PagedKVCache | None = None,
                 rowwise: list[int] | None = None):
        self.max_bytes = max_bytes
        self.block = block
        self.pool = pool
        self.rowwise = rowwise or []
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._ids = itertools.count(1)
        self.stats = {"hit_tokens": 0, "lookups": 0, "evicted_blocks": 0}
        if pool is not None:
            assert pool.page == block, "a cached block is one page"
            if self.enabled:
                pool.reclaim = self.reclaim
                pool.on_remap = self.remap

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    def _chain(self, weights: Hashable, tokens: list[int], upto: int):
        """Yield ``(key, entry or None)`` for the full blocks of ``tokens[:upto]`` until the first miss."""
        parent = 0
        for start in range(0, upto - upto % self.block, self.block):
            key = (weights, parent, tuple(tokens[start: start + self.block]))
            entry = self.entries.get(key)
            yield key, entry
            if entry is None:
                return
            parent = entry.id

    def lookup(self, weights: Hashable, tokens: list[int], limit: int) -> list[_Entry]:
        """The cached blocks of the longest cached prefix of ``tokens`` (at most ``limit``
        positions), first block first; marks them recently used."""
        if not self.enabled:
            return []
        self.stats["lookups"] += 1
        keys, entries = [], []
        for key, entry in self._chain(weights, tokens, limit):
            if entry is None:
                break
            keys.append(key)
            entries.append(entry)
        self._touch(keys)
        self.stats["hit_tokens"] += len(entries) * self.block
        return entries

    def peek(self, weights: Hashable, tokens: list[int], limit: int) -> list[_Entry]:
        """What :meth:`lookup` would find, without marking anything used: for admission weighing
        what a prefill would compute and hold."""
        if not self.enabled:
            return []
        return [entry for _, entry in self._chain(weights, tokens, limit) if entry is not None]

    def cached_tokens(self, weights: Hashable, tokens: list[int], limit: int) -> int:
        """Positions of ``tokens`` (at most ``limit``) that :meth:`lookup` would find (see :meth:`peek`)."""
        return len(self.peek(weights, tokens, limit)) * self.block

    @staticmethod
    def pages_of(entries: list[_Entry]) -> list[int]:
        """The pool pages of looked-up blocks (empty for blocks that are tensors)."""
        return [e.page for e in entries if e.page is not None]

    def read_into(self, out: torch.Tensor, entries: list[_Entry], paged: bool = True) -> None:
        """Copy looked-up blocks' K/V into ``out`` ``(layers, 2, kv_heads, width, head_dim)`` (one
        prompt's prefill buffer), positions ``[0, len(entries) * block)``. ``paged=False``: only
        the layers beside the pool's pages (whoever holds the pages reads those itself)."""
        if not entries:
            return
        n = len(entries) * self.block
        if self.pool is None:
            out[:, :, :, :n] = torch.cat([e.kv for e in entries], dim=3)
            return
        if paged:
            self.pool.read_pages(out[..., :n, :], self.pages_of(entries))
        if self.rowwise:
            out[self.rowwise, :, :, :n] = torch.cat([e.kv for e in entries], dim=3)

    def insert(self, weights: Hashable, tokens: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Keep the full blocks of a prefilled prompt ``tokens`` (blocks that are tensors). ``kv``
        is ``(layers, 2, kv_heads, n, head_dim)``: the K/V of positions ``start, start + 1, ...``
        (the blocks before ``start`` came from this cache). Blocks already cached are left as
        they are."""
        if not self.enabled:
            return
        assert self.pool is None, "a paged cache's blocks are adopted from its rows (see adopt)"
        per_block = kv[:, :, :, :1].numel() * kv.element_size() * self.block
        self._add(weights, tokens, start, per_block,
                  lambda s: _Entry(next(self._ids), kv[:, :, :, s - start: s - start + self.block].clone()))

    def adopt(self, weights: Hashable, tokens: list[int], pages: list[int], kv: torch.Tensor | None = None) -> None:
        """Keep a prompt's full pages: ``pages[b]`` holds positions ``[b * block, (b + 1) * block)``
        of ``tokens`` (a row was just written into them); ``kv`` ``(layers, 2, kv_heads, n,
        head_dim)``: the prompt's K/V from position 0, of which the blocks keep the layers beside
        the pages. Blocks already cached keep their own pages."""
        if not self.enabled:
            return
        assert self.pool is not None
        per_block = self.pool.page_bytes()
        if self.rowwise:
            assert kv is not None
            per_block += kv[self.rowwise, :, :, :1].numel() * kv.element_size() * self.block

        def entry(s: int) -> _Entry:
            page = pages[s // self.block]
            self.pool.hold([page])
            rest = kv[self.rowwise, :, :, s: s + self.block].clone() if self.rowwise else None
            return _Entry(next(self._ids), rest, page)

        self._add(weights, tokens[: len(pages) * self.block], 0, per_block, entry)

    def _add(self, weights: Hashable, tokens: list[int], start: int, per_block: int,
             make: Callable[[int], _Entry]) -> None:
        """Walk the full blocks of ``tokens``, making (``make(first position)``) those not cached."""
        if per_block > self.max_bytes:
            return
        chain: list[tuple] = []
        parent = 0
        for s in range(0, len(tokens) - len(tokens) % self.block, self.block):
            key = (weights, parent, tuple(tokens[s: s + self.block]))
            entry = self.entries.get(key)
            if entry is None:
                if s < start:  # evicted since it was read, and its K/V are not at hand: the chain ends here
                    break
                entry = make(s)
                self.entries[key] = entry
                self.bytes += per_block
            chain.append(key)
            parent = entry.id
        self._touch(chain)
        self._evict(self.max_bytes)

    def _touch(self, keys: list[tuple]) -> None:
        for key in reversed(keys):  # the first block ends most recently used (see the module docstring)
            self.entries.move_to_end(key)

    def _evict(self, budget: int) -> None:
        while self.bytes > budget and self.entries:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.bytes -= self._bytes_of(entry)
        self.stats["evicted_blocks"] += 1
        if entry.page is not None:
            assert self.pool is not None
            self.pool.let_go([entry.page])  # freed unless a row still holds it

    def _bytes_of(self, entry: _Entry) -> int:
        kv = 0 if entry.kv is None else entry.kv.numel() * entry.kv.element_size()
        return kv + (self.pool.page_bytes() if entry.page is not None and self.pool is not None else 0)

    def reclaim(self) -> bool:
        """Evict the least recently used block (the pool needs a page); False when none is left."""
        if not self.entries:
            return False
        self._drop_oldest()
        return True

    def remap(self, moved: dict[int, int]) -> None:
        """The pool moved pages: block pages ``old`` are now ``moved[old]``."""
        for entry in self.entries.values():
            if entry.page is not None:
                entry.page = moved[entry.page]

    def clear(self) -> None:
        """Drop every block (memory pressure: the device needs the room more than the cache)."""
        self._evict(0)
