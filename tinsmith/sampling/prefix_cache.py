"""Prefix cache: prompts' K/V kept across requests, in fixed-size blocks, evicted least recently used.

RL programs send one prompt as many separate requests (GRPO: 16 per prompt) and multi-turn
prompts repeat every earlier turn; without this each request prefills its whole prompt again.

A block holds ``BLOCK`` consecutive prompt positions of every layer's K and V, as one tensor
``(layers, 2, kv_heads, BLOCK, head_dim)`` on the model's device. Blocks are keyed as a
chain: ``(weights, parent block id, its tokens)``, so a block stands for its whole prefix (the
K/V of a position depend on every token before it) and a prompt reuses its longest chain of
cached blocks. Keys compare the tokens themselves (dict equality), never only a hash, so a
collision cannot hand one prompt another's K/V.

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
from dataclasses import dataclass
from typing import Hashable

import torch

BLOCK = 16  # prompt positions per cached block: small enough that most of a shared prompt is reused
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass
class _Entry:
    id: int
    kv: torch.Tensor  # (layers, 2, kv_heads, BLOCK, head_dim)


class PrefixCache:
    """K/V of prompt blocks under a byte budget (0: nothing is ever kept)."""

    def __init__(self, max_bytes: int, block: int = BLOCK):
        self.max_bytes = max_bytes
        self.block = block
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._ids = itertools.count(1)
        self.stats = {"hit_tokens": 0, "lookups": 0, "evicted_blocks": 0}

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

    def lookup(self, weights: Hashable, tokens: list[int], limit: int) -> list[torch.Tensor]:
        """The cached blocks of the longest cached prefix of ``tokens`` (at most ``limit``
        positions), first block first; marks them recently used."""
        if not self.enabled:
            return []
        self.stats["lookups"] += 1
        keys, blocks = [], []
        for key, entry in self._chain(weights, tokens, limit):
            if entry is None:
                break
            keys.append(key)
            blocks.append(entry.kv)
        self._touch(keys)
        self.stats["hit_tokens"] += len(blocks) * self.block
        return blocks

    def insert(self, weights: Hashable, tokens: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Keep the full blocks of a prefilled prompt ``tokens``. ``kv`` is ``(layers, 2, kv_heads,
        n, head_dim)``: the K/V of positions ``start, start + 1, ...`` (the blocks before ``start``
        came from this cache). Blocks already cached are left as they are."""
        if not self.enabled:
            return
        per_block = kv[:, :, :, :1].numel() * kv.element_size() * self.block
        if per_block > self.max_bytes:
            return
        chain: list[tuple] = []
        parent = 0
        n_full = len(tokens) // self.block
        for b in range(n_full):
            s = b * self.block
            key = (weights, parent, tuple(tokens[s: s + self.block]))
            entry = self.entries.get(key)
            if entry is None:
                if s < start:  # evicted since it was read, and its K/V are not at hand: the chain ends here
                    break
                entry = _Entry(next(self._ids), kv[:, :, :, s - start: s - start + self.block].clone())
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
            _, entry = self.entries.popitem(last=False)
            self.bytes -= entry.kv.numel() * entry.kv.element_size()
            self.stats["evicted_blocks"] += 1

    def clear(self) -> None:
        """Drop every block (memory pressure: the device needs the room more than the cache)."""
        self._evict(0)
