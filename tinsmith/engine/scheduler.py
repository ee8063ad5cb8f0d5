"""The engine: orders each training run's requests, batches runs together, completes futures.

Sharing the device between training and sampling: when both have work, the engine alternates
one training call with one sampling time slice (``sampling_slice_s`` of decode steps, with
new requests joining between steps). Neither can starve the other; a training call is never
interrupted, so a very large forward_backward delays sampling by its own duration.

* Every accepted request becomes a :class:`Job` in its model's queue, ordered by ``seq_id``.
  A model runs one job at a time (its next job waits for the previous one), so a run's
  forward_backward / optim_step / save sequence is applied in the order the client sent it.
* When the worker is free, the engine takes every model's head job. Consecutive
  forward/backward jobs of every model are sent to the worker as **one** call (runs of many
  tenants on one base model share micro-batches); other kinds run one by one, cheap ones
  first.
* Results are persisted by the executor thread, then pushed to waiting long-polls through
  asyncio futures: no polling interval sits on the hot path.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinsmith.errors import TinsmithError

log = logging.getLogger(__name__)

BATCHED_KINDS = ("forward_backward", "forward")

_order = itertools.count()


@dataclass
class Job:
    request_id: str
    kind: str
    model_id: str | None
    seq_id: int | None
    args: Any
    wire: str = "json"  # how the result is encoded for the client: "json" | "protobuf"
    owner: str = ""
    internal: bool = False  # issued by the server itself (no client future, nothing to persist)
    enqueued_at: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_order))

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.seq_id if self.seq_id is not None else 1 << 62, self.order)


@dataclass(frozen=True)
class Outcome:
    """What a job produced: an encoded result, or an error for the client."""

    result: bytes | None = None
    content_type: str = "application/json"
    error: str | None = None
    category: str = "server"

    @classmethod
    def failure(cls, exc: BaseException) -> "Outcome":
        if isinstance(exc, TinsmithError):
            return cls(error=exc.message, category=exc.category)
        return cls(error=f"internal error: {type(exc).__name__}: {exc}", category="server")


class Operations(Protocol):
    """Executes jobs (in the executor thread). Supplied by the server assembly."""

    def run_batch(self, kind: str, jobs: list[Job]) -> list[Outcome]: ...

    def run_one(self, job: Job) -> Outcome: ...

    # Continuous work (sampling): jobs join a running batch and finish at their own pace.
    def sample_submit(self, job: Job) -> None: ...  # thread-safe, called on the event loop

    def sample_has_work(self) -> bool: ...

    def sample_step(self, budget_s: float) -> list[tuple[Job, Outcome]]: ...

    def sample_abort(self) -> list[Job]: ...  # drop every queued and running sample job


class ResultSink(Protocol):
    def complete_request(self, request_id: str, result: bytes, content_type: str) -> bool: ...

    def fail_request(self, request_id: str, error: str, category: str = "server") -> bool: ...


class Engine:
    def __init__(self, operations: Operations, sink: ResultSink, executor: Executor | None = None,
                 cheap_kinds: tuple[str, ...] = ("optim_step", "create_model", "unload_model"),
                 sampling_slice_s: float = 0.05):
        self.ops = operations
        self.sink = sink
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinsmith-worker")
        self.cheap_kinds = cheap_kinds
        self.sampling_slice_s = sampling_slice_s
        self.queues: dict[str, list[Job]] = {}
        self.unordered: list[Job] = []  # jobs without a model (sampling etc.)
        self.busy_models: set[str] = set()
        self.waiters: dict[str, asyncio.Future[Outcome]] = {}
        self.owners: dict[str, str] = {}  # request_id -> owner, while the job is queued or running
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"batches": 0, "jobs": 0, "max_batch_models": 0}

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._dispatch_loop(), name="tinsmith-engine")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=True, cancel_futures=True)

    # ----------------------------------------------------------------------------- submission
    def submit(self, job: Job) -> None:
        """Queue a persisted request. Must be called on the event loop."""
        self.waiters.setdefault(job.request_id, asyncio.get_running_loop().create_future())
        self.owners[job.request_id] = job.owner
        if job.kind == "sample":
            self.ops.sample_submit(job)
        elif job.model_id is None:
            self.unordered.append(job)
        else:
            q = self.queues.setdefault(job.model_id, [])
            keys = [j.sort_key for j in q]
            q.insert(bisect.bisect(keys, job.sort_key), job)
        self._wake.set()

    def pending(self, request_id: str) -> bool:
        w = self.waiters.get(request_id)
        return w is not None and not w.done()

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The job's outcome once done (None on timeout or if the engine does not know it)."""
        w = self.waiters.get(request_id)
        if w is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(w), timeout)
        except asyncio.TimeoutError:
            return None

    def owner_of(self, request_id: str) -> str | None:
        return self.owners.get(request_id)

    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values()) + len(self.unordered)

    # ----------------------------------------------------------------------------- dispatch
    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sampling_turn = False
        while True:
            training = self._has_training_work()
            sampling = self.ops.sample_has_work()
            if not training and not sampling:
                self._wake.clear()
                await self._wake.wait()
                continue
            if sampling and (sampling_turn or not training):
                sampling_turn = False
                try:
                    pairs = await loop.run_in_executor(self.executor, self._sample_slice)
                except Exception as exc:  # fail what the sampler held, rather than leave it hanging
                    log.exception("sampling step failed")
                    pairs = [(j, Outcome.failure(exc)) for j in self.ops.sample_abort()]
                    await loop.run_in_executor(None, self._persist, [j for j, _ in pairs], [o for _, o in pairs])
                self._finish([j for j, _ in pairs], [o for _, o in pairs])
                await asyncio.sleep(0)  # let submissions in between slices
                continue
            sampling_turn = True
            work = self._take_work()
            if work is None:
                continue
            kind, jobs = work
            try:
                outcomes = await loop.run_in_executor(self.executor, self._execute, kind, jobs)
            except Exception as exc:  # the executor itself failed: fail the jobs, keep serving
                log.exception("worker call failed")
                outcomes = [Outcome.failure(exc) for _ in jobs]
                await loop.run_in_executor(None, self._persist, jobs, outcomes)
            self._finish(jobs, outcomes)

    def _has_training_work(self) -> bool:
        return bool(self.unordered) or any(q and m not in self.busy_models for m, q in self.queues.items())

    def _sample_slice(self) -> list[tuple[Job, Outcome]]:
        pairs = self.ops.sample_step(self.sampling_slice_s)
        self._persist([j for j, _ in pairs], [o for _, o in pairs])
        return pairs

    def _take_work(self) -> tuple[str, list[Job]] | None:
        """Pick the next worker call: cheap heads first, then one batch of forward/backward heads."""
        heads = [(m, q[0]) for m, q in self.queues.items() if q and m not in self.busy_models]
        for m, job in sorted(heads, key=lambda mj: mj[1].order):
            if job.kind in self.cheap_kinds:
                return self._claim(job.kind, [job])
        fb = [(m, q) for m, q in self.queues.items() if q and m not in self.busy_models and q[0].kind in BATCHED_KINDS]
        if fb:
            jobs: list[Job] = []
            for _, q in fb:
                for j in q:  # a run's consecutive forward/backward requests commute: take them all
                    if j.kind not in BATCHED_KINDS:
                        break
                    jobs.append(j)
            self.stats["max_batch_models"] = max(self.stats["max_batch_models"], len(fb))
            return self._claim("forward_backward", jobs)
        for m, job in sorted(heads, key=lambda mj: mj[1].order):
            return self._claim(job.kind, [job])
        if self.unordered:
            return self._claim(self.unordered[0].kind, [self.unordered.pop(0)])
        return None

    def _claim(self, kind: str, jobs: list[Job]) -> tuple[str, list[Job]]:
        for j in jobs:
            if j.model_id is not None:
                self.busy_models.add(j.model_id)
                q = self.queues[j.model_id]
                q.remove(j)
        return kind, jobs

    def _execute(self, kind: str, jobs: list[Job]) -> list[Outcome]:
        """Runs in the executor thread: do the work, then persist every outcome."""
        try:
            outcomes = self.ops.run_batch(kind, jobs) if kind == "forward_backward" else [self.ops.run_one(jobs[0])]
        except Exception as exc:
            if not isinstance(exc, TinsmithError):
                log.exception("%s failed", kind)
            outcomes = [Outcome.failure(exc) for _ in jobs]
        self._persist(jobs, outcomes)
        return outcomes

    def _persist(self, jobs: list[Job], outcomes: list[Outcome]) -> None:
        for job, out in zip(jobs, outcomes):
            if job.internal:
                if out.error is not None:
                    log.warning("internal %s for %s failed: %s", job.kind, job.model_id, out.error)
                continue
            try:
                if out.error is None:
                    self.sink.complete_request(job.request_id, out.result or b"{}", out.content_type)
                else:
                    self.sink.fail_request(job.request_id, out.error, out.category)
            except Exception:
                log.exception("could not persist the outcome of %s", job.request_id)

    def _finish(self, jobs: list[Job], outcomes: list[Outcome]) -> None:
        if not jobs:
            return
        self.stats["batches"] += 1
        self.stats["jobs"] += len(jobs)
        for job, out in zip(jobs, outcomes):
            if job.model_id is not None and job.kind != "sample":
                self.busy_models.discard(job.model_id)
                if not self.queues.get(job.model_id):
                    self.queues.pop(job.model_id, None)
            self.owners.pop(job.request_id, None)
            w = self.waiters.pop(job.request_id, None)
            if w is not None and not w.done():
                w.set_result(out)
        self._wake.set()
