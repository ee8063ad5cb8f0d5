"""Tickets: the last of several programs finishing one sum does the step after it, in one launch.

A reduction split over several programs (the LoRA shrink's split-K, decode attention's splits of
a row's keys) leaves partial results that something must add up. A second kernel doing it costs a
launch (about 2 us on an H200, several a decode layer). Instead every program stores its partial
and takes a ticket: an atomic count per output tile, in a counter array kept per device. The
program that draws the last ticket adds the partials up, in a fixed order (so the result never
depends on which program came last, and a replayed CUDA graph equals the eager step bit for bit),
and sets the count back to zero for the next launch. The atomics only count.

- :func:`counters`: a device's zeroed int32 counters (:data:`CAPACITY` of them; a launch with more
  output tiles than that takes its two-launch path);
- in a kernel: ``ticket = take(counter)`` after the partial is stored (a barrier, then one
  thread's acquire-release add, broadcast to the program), then the partials read with
  ``cache_modifier=".cg"`` where ``ticket == count - 1``, then ``hand_back(counter, ticket,
  count, BLOCK)``.
"""

from __future__ import annotations

import torch

try:  # optional: ``pip install 'tinsmith[gpu]'``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# Counters a device keeps: output tiles (rows x blocks of one call) a launch may count on.
CAPACITY = 1 << 14
_counters: dict[tuple, torch.Tensor] = {}


def fits(tiles: int) -> bool:
    """Whether a launch of ``tiles`` output tiles can take tickets."""
    return tiles <= CAPACITY


def counters(device: torch.device) -> torch.Tensor:
    """``device``'s zeroed int32 counters. Every launch leaves them at zero, so launches that run
    one after another share them, captured graphs too (their first step runs eagerly before the
    capture, which makes them outside the graph's memory). Launches on one device must not run at
    once on two streams: the engine issues a device's work in order (a side stream's warm-up step
    is joined before anything else runs). Never freed: a captured graph holds their address."""
    index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
    key = (device.type, index)
    found = _counters.get(key)
    if found is None:
        found = _counters[key] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return found


if triton is not None:

    @triton.jit
    def take(counter):
        """This program's ticket on ``counter`` (0 for the first to finish), taken once every
        thread's partial is stored: the add releases the partial and acquires the others'."""
        tl.debug_barrier()
        return tl.atomic_add(counter, 1, sem="acq_rel")

    @triton.jit
    def hand_back(counter, ticket, count, BLOCK: tl.constexpr):
        """The last of ``count`` programs sets ``counter`` back to zero for the next launch (one
        lane of a ``BLOCK``-wide store; the ticket compared per element, which every Triton
        version's interpreter takes as a mask)."""
        lanes = tl.arange(0, BLOCK)
        tl.store(counter + lanes * 0, lanes * 0, mask=(lanes == 0) & ((lanes * 0 + ticket) == count - 1))


__all__ = ["CAPACITY", "counters", "fits", "hand_back", "take"]
