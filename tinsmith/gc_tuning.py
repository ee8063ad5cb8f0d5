"""Keep Python's cyclic garbage collector out of the way of a serving process.

After start-up a server process holds about 400,000 objects that the collector tracks (the
modules and classes of torch, transformers, SQLAlchemy, FastAPI and pydantic, the models' modules,
the store's mappings). They live until the process exits, yet every collection of the oldest
generation walks them all with the interpreter lock held, and no thread of the process runs
meanwhile: not the event loop taking requests, not the thread that launches the device's kernels.
Measured on the CPU box (docs/performance.md, "Garbage collection"): one such collection took
155-300 ms; a training step of four tenants met one every ten steps (14-25 ms a step on average),
one of sixteen tenants every five or six (37-46 ms a step); separate sample requests met one every
few hundred requests, and cyclic collection was about a fifth of the server's interpreter time
under that load.

Two settings, as long-running Python servers use them (vLLM's API server freezes its start-up
heap the same way):

- :func:`tune_for_serving` collects what start-up left as garbage and moves every surviving
  object to the permanent generation (``gc.freeze``): later collections walk only what was made
  since. Frozen objects are still freed when their last reference goes; only a reference cycle
  among them would stay, and start-up state lives as long as the process anyway.
- The youngest generation is collected every :data:`YOUNGEST_THRESHOLD` net allocations of
  tracked objects instead of CPython's 700. A training step makes thousands of tensors that live
  for the step; at 700 many were still alive at each young collection, so they were promoted and
  walked again by the older generations. A young collection now costs a few milliseconds at most.
  What the collector frees later is only what sits in reference cycles, and training steps and
  sampling make none (tests/worker/test_no_cyclic_garbage.py), so no activation or K/V block waits
  longer for it; the cycles the web framework and the database layer make hold no tensors.

:data:`PAUSES` records every collection's pause (``/metrics``: ``tinsmith_gc_collections`` and
``tinsmith_gc_pause_seconds``), so that an operator sees what the collector costs.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

YOUNGEST_THRESHOLD = 10_000


def tune_for_serving() -> int:
    """Freeze the start-up heap and raise the youngest generation's threshold; the number of
    objects frozen. Call it once the process's long-lived state is built (models loaded,
    application created), before it takes work; :func:`release_at_exit` when it stops."""
    started = time.perf_counter()
    PAUSES.install()
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNGEST_THRESHOLD, middle, oldest)
    frozen = gc.get_freeze_count()
    log.debug("garbage collection: %d start-up objects frozen in %.0f ms, youngest generation every %d allocations",
              frozen, 1e3 * (time.perf_counter() - started), YOUNGEST_THRESHOLD)
    return frozen


def release_at_exit() -> None:
    """Hand the frozen objects back to the collector, so that what the process's shutdown frees is
    freed in order (native extensions otherwise report their objects as leaked at exit)."""
    gc.unfreeze()


@contextmanager
def tuned_for_serving() -> Iterator[int]:
    """:func:`tune_for_serving` for the length of a block (it yields the objects frozen), then
    the collector's settings as they were: a benchmark that runs the worker in its own process,
    as the server does, may itself run inside another program (a test)."""
    threshold = gc.get_threshold()
    try:
        yield tune_for_serving()
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


class PauseRecorder:
    """Counts the collections of each generation and the time they held the process, through
    ``gc.callbacks`` (two clock reads a collection). Process-wide, like the collector itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = 0.0
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.installed = False

    def install(self) -> None:
        """Start recording (once per process; later calls do nothing)."""
        with self._lock:
            if not self.installed:
                gc.callbacks.append(self._on_collection)
                self.installed = True

    def _on_collection(self, phase: str, info: dict) -> None:
        # Collections do not overlap (the collector holds the interpreter lock throughout).
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started

    def readings(self) -> list[tuple[int, int, float]]:
        """(generation, collections, seconds paused) of each generation, since install."""
        return [(g, self.collections[g], self.seconds[g]) for g in range(3)]


PAUSES = PauseRecorder()
