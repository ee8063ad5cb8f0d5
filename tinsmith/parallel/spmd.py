"""Driving every rank of a tensor-parallel group from one place (single program, multiple data).

The engine talks to rank 0 only. Rank 0's :meth:`SpmdExecutor.call` broadcasts the call (method
name and arguments: the batch description, e.g. the requests with their tokens) to the other
ranks, which wait in :meth:`SpmdExecutor.follow`; then every rank runs the same method of its own
runtime, whose collectives meet. After the call the ranks exchange their outcomes, so a failure
on any rank is known to all: a call that raised the same error everywhere (a request refused by
validation) leaves the group usable and raises that error on rank 0; a call that failed on some
ranks only leaves the ranks out of step, so every rank raises :class:`ParallelError` and the
group must be restarted. A rank that dies or hangs inside a collective fails the others through
the group's timeout.

That timeout bounds every collective, so followers must not wait for the next call in one (an
idle server would lose its ranks after the timeout): with a ``doorbell``, the driver rings it
before each call and the followers wait on it, for as long as it takes, before they join the
broadcast.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from tinsmith.parallel.group import ParallelError, TPGroup, guarded

_STOP = "__stop__"


class Doorbell(Protocol):
    """How the driver tells the followers a call is coming, outside the group's collectives."""

    def ring(self) -> None: ...  # on the driver: raises ParallelError when a follower cannot be told

    def wait(self) -> bool: ...  # on a follower: blocks until rung; False when the driver is gone


class SpmdExecutor:
    """Runs methods of ``target`` (e.g. a :class:`TPTrainingRuntime`) on every rank at once."""

    def __init__(self, target: Any, tp: TPGroup, driver: int = 0, doorbell: Doorbell | None = None):
        self.target, self.tp, self.driver = target, tp, driver
        self.doorbell = doorbell
        self.calls = 0

    @property
    def is_driver(self) -> bool:
        return self.tp.rank == self.driver

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """On the driver: run ``target.method(*args, **kwargs)`` on every rank; the driver's result."""
        if not self.is_driver:
            raise RuntimeError("only the driver rank issues calls; the others run follow()")
        if self.doorbell is not None:
            self.doorbell.ring()
        self._broadcast([(method, args, kwargs)])
        return self._run(method, args, kwargs)

    def stop(self) -> None:
        """On the driver: release the followers from :meth:`follow`."""
        if self.doorbell is not None:
            self.doorbell.ring()
        self._broadcast([(_STOP, (), {})])

    def follow(self) -> int:
        """On the other ranks: run each call the driver broadcasts, until it stops. Returns the
        number of calls run."""
        while True:
            if self.doorbell is not None and not self.doorbell.wait():
                return self.calls  # the driver is gone: nothing more will come
            if not self.follow_call():
                return self.calls

    def follow_call(self) -> bool:
        """On the other ranks: run the one call the driver is about to broadcast (the caller knows
        one is coming: its doorbell rang, or the driver asked for it); False when it was the stop.
        Errors that the driver also saw are its to report."""
        box: list = [None]
        self._broadcast(box)
        method, args, kwargs = box[0]
        if method == _STOP:
            return False
        try:
            self._run(method, args, kwargs)
        except ParallelError:
            raise
        except Exception:  # the same error was raised on the driver, which reports it
            pass
        return True

    def _broadcast(self, box: list) -> None:
        guarded(self.tp, "call broadcast", lambda: dist.broadcast_object_list(box, src=self.driver, group=self.tp.group))

    def _run(self, method: str, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        result, error = None, None
        try:
            result = getattr(self.target, method)(*args, **kwargs)
        except ParallelError:
            raise
        except Exception as exc:
            error = exc
        outcomes: list = [None] * self.tp.size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        guarded(self.tp, f"outcome exchange after {method}",
                lambda: dist.all_gather_object(outcomes, mine, group=self.tp.group))
        if len(set(outcomes)) > 1:
            raise ParallelError(f"ranks disagree after {method}: " + "; ".join(
                f"rank {r}: {o or 'ok'}" for r, o in enumerate(outcomes)) + " (the group must be restarted)")
        if error is not None:
            raise error
        return result
