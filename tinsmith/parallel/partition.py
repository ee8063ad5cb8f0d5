"""Splitting work over ranks so that each gets about the same amount, the same on every rank."""

from __future__ import annotations

import heapq


def longest_first(sizes: list[int], world: int) -> list[list[int]]:
    """Which items (indices into ``sizes``) each of ``world`` ranks takes: largest first onto the
    rank with the least so far (ties: the lower rank; equal sizes in index order), each rank's in
    index order. Deterministic, so every rank computes the same split without communicating; no
    rank gets more than ``sum(sizes) / world`` plus the largest item."""
    heap = [(0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + sizes[i], r))
    return [sorted(x) for x in out]


def chunk_rows(n: int, world: int) -> list[int]:
    """Rows each of ``world`` ranks holds of ``n`` split as ``torch.chunk`` splits them (FSDP2's
    ``Shard(0)``): ``ceil(n / world)`` each, the last ranks fewer, or none."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]
