"""CPU time of a process, or of one of its threads, read from Linux's ``/proc``: how much of a
benchmark's work was the server's, its event loop's, or the client's (the SDK's) own.

A server's main thread runs its event loop (uvicorn), so ``thread=pid`` reads the loop's share;
the rest of the process's time is its worker threads (the store, the sampler, the engine).
"""

from __future__ import annotations

import os


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), or of its thread ``thread``."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread (a client's SDK thread included)."""
    t = os.times()
    return t.user + t.system
