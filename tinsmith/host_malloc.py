"""glibc's allocator set for a serving process: large tensors made every step reuse memory rather
than having it mapped, faulted in and unmapped each time.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. glibc serves an allocation above its
mmap threshold (128 KiB at first, raised as such blocks are freed, at most 32 MiB) with a fresh
mapping, which the kernel faults in and zeroes page by page and which goes back to the system when
freed; it also hands the free top of a heap back once more than its trim threshold is free; and
threads other than the main one allocate from arenas of their own, heaps of at most 64 MiB each.
A decode step of 64 rows over Qwen3's 151,936-entry vocabulary makes logits of 39 MB and several
fp32 tensors that size for the token choice: every step, each was mapped, faulted in and unmapped.
On the CPU box (docs/performance.md, "glibc's allocator") a 64-row decode over that vocabulary ran
at about 350-370 tokens/s on a thread of its own, and at 715-750 with the settings below.

The settings (``mallopt``, at the start of the process, before it starts threads): one arena for
every thread (``M_ARENA_MAX``: the thread that runs the device's work allocates from the main heap,
which grows without the other arenas' 64 MiB limit), allocations under :data:`HEAP_BELOW` from the
heap (``M_MMAP_THRESHOLD``), and up to :data:`HEAP_BELOW` of free heap top kept
(``M_TRIM_THRESHOLD``). Small allocations are still served from per-thread caches (glibc's tcache),
so the one arena is rarely contended. The process keeps memory it freed for its next steps, as
PyTorch's caching allocator does on a GPU; what it keeps can be a few times the peak of live
tensors, since small allocations land between the large blocks freed and a step now and then grows
the heap until its layout settles (docs/operating.md: 420 MB kept for a step of 117 MB at most).

Nothing is changed where the C library is not glibc, or where the operator chose the allocator's
settings already (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``, or another allocator in ``LD_PRELOAD``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

HEAP_BELOW = 1 << 30  # bytes: allocations below this come from the heap, and this much free heap is kept
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
_OPERATOR_CHOICES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def tune_for_serving() -> str | None:
    """Apply the settings (module docstring) to this process; why not, when they were not applied
    (None: applied)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    chosen = [name for name in _OPERATOR_CHOICES if os.environ.get(name)]
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc
        chosen.append("LD_PRELOAD")
    if chosen:
        return f"the allocator's settings were chosen in the environment ({', '.join(chosen)})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(option, value) == 1 for option, value in (
            (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, HEAP_BELOW), (_M_TRIM_THRESHOLD, HEAP_BELOW)))
    except (OSError, AttributeError) as exc:
        return f"mallopt is not available ({exc})"
    if not ok:
        return "glibc refused a setting"
    log.debug("glibc's allocator: one arena, allocations under %d MiB from the heap, that much free heap kept",
              HEAP_BELOW >> 20)
    return None
