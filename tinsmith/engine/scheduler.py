"""The engine: orders each training run's requests, shares the device fairly, completes futures.

* Every accepted request becomes a :class:`Job` in its model's queue, ordered by ``seq_id``.
  A model runs one job at a time, in ``seq_id`` order. A job whose predecessors have not
  arrived yet (the SDK sends the chunks of a large forward_backward concurrently, the first
  one last) is held back until they do, or until ``seq_gap_wait_s`` has passed (a request
  refused at the door leaves a gap that nothing will fill).
* Forward/backward work is cut into **chunks** of about one micro-batch of tokens. Each chunk
  takes datums from every running forward/backward *pass* (a model's consecutive
  forward/backward requests), so tenants share micro-batches, and shares the chunk among API
  keys by weighted fair queueing over tokens: busy keys get equal tokens over time, and a
  small request of a key that was idle goes first in the next chunk. A huge request therefore advances a chunk at
  a time while small requests of other keys start and finish between its chunks.
* Everything else (optim_step, save/load, create, unload) runs before the next chunk, keys
  taking turns, so checkpoint I/O never waits behind other tenants' compute; several runs'
  optimizer steps ready together go to the worker as one call. When a key that was idle has a
  forward/backward ready, one chunk runs first (its request at the front of it), so that it does
  not wait for every busy key's optimizer step as well.
* Training and sampling take turns: a training turn (the ready single jobs, then one chunk) or
  a sampling slice (``sampling_slice_s`` of decode steps, new requests joining between steps).
  Which one goes next is decided by the device time each kind has had per key with work of that
  kind (:mod:`tinsmith.engine.device_shares`), so a sampling key beside a training key gets half
  the device however long a chunk takes next to a slice, and neither can starve the other.
* Results are persisted by the executor thread, then pushed to waiting long-polls through
  asyncio futures: no polling interval sits on the hot path.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections import Counter, deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from collections.abc import Callable
from typing import Any, Protocol

from tinsmith.engine.device_faults import device_fault
from tinsmith.engine.device_shares import DeviceShares
from tinsmith.errors import TinsmithError
from tinsmith.store.records import RequestOutcome
from tinsmith.tenants import key_id

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
    wire: str = "json"  # how the result is encoded: "json" | "protobuf" (the SDKs) | "sequences" (OpenAI routes)
    owner: str = ""
    internal: bool = False  # issued by the server itself (no client future, nothing to persist)
    topic: str | None = None  # listeners of this topic (a sampler's retrieve_futures polls) wake when it finishes
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the worker began it (queue wait ends here)
    finished_at: float | None = None  # when its outcome was ready (before it is pushed to waiters)
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
    device_fault: str | None = None  # the error means the device itself failed (see device_faults)
    # What the run's history records with the result (a store ``MetricPoint``), written in the
    # same transaction; None for results that report no metrics.
    metric_point: Any = None

    @classmethod
    def failure(cls, exc: BaseException) -> "Outcome":
        if isinstance(exc, TinsmithError):
            return cls(error=exc.message, category=exc.category)
        return cls(error=f"internal error: {type(exc).__name__}: {exc}", category="server",
                   device_fault=device_fault(exc))


class Operations(Protocol):
    """Executes jobs (in the executor thread). Supplied by the server assembly."""

    def run_one(self, job: Job) -> Outcome: ...

    # Several runs' optim_step jobs at once (each as run_one would): an outcome or an error each.
    def run_optim_steps(self, jobs: list[Job]) -> list[Outcome | Exception]: ...

    # Forward/backward passes, run a chunk at a time. A handle is whatever train_begin returns.
    def train_begin(self, jobs: list[Job]) -> Any: ...  # one model's consecutive forward/backward jobs

    # Run each entry's quota of tokens, about ``budget`` in all; returns the tokens run per entry.
    # on_done(handle) is called (executor thread) the moment a pass completes.
    def train_advance(self, quotas: list[tuple[Any, int]], budget: int,
                      on_done: Callable[[Any], None]) -> list[int]: ...

    def train_done(self, handle: Any) -> bool: ...

    def train_pending(self, handle: Any, tokens: int) -> list[int]: ...  # next datums' lengths, ~tokens worth

    def train_outcomes(self, handle: Any, jobs: list[Job]) -> list[Outcome]: ...

    def train_chunk_tokens(self, keys: int) -> int: ...  # tokens one chunk runs when ``keys`` keys have work

    # Continuous work (sampling): jobs join a running batch and finish at their own pace.
    def sample_submit(self, job: Job) -> None: ...  # thread-safe, called on the event loop

    def sample_has_work(self) -> bool: ...

    def sample_step(self, budget_s: float) -> list[tuple[Job, Outcome]]: ...

    def sample_abort(self) -> list[Job]: ...  # drop every queued and running sample job

    def sample_cancel(self, request_id: str) -> None: ...  # drop one sample job (event loop; it finishes as cancelled)

    def sample_forget(self, request_id: str) -> None: ...  # the sample job finished (event loop)

    def device_settle(self) -> None: ...  # wait for the device's queued work (a turn's time is then its own)


class ResultSink(Protocol):
    def finish_requests(self, outcomes: list[RequestOutcome]) -> list[bool]: ...  # one transaction


@dataclass
class _Pass:
    """One model's consecutive forward/backward jobs, running a chunk at a time."""

    model_id: str
    owner: str
    jobs: list[Job]
    handle: Any = None  # the operations' handle, once begun


class Engine:
    def __init__(self, operations: Operations, sink: ResultSink, executor: Executor | None = None,
                 sampling_slice_s: float = 0.05, seq_gap_wait_s: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.ops = operations
        self.sink = sink
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinsmith-worker")
        self.sampling_slice_s = sampling_slice_s
        self.seq_gap_wait_s = seq_gap_wait_s
        self.queues: dict[str, list[Job]] = {}
        self.busy_models: set[str] = set()
        self.passes: list[_Pass] = []  # running forward/backward passes, oldest first
        self.next_seq: dict[str, int] = {}  # model -> the seq_id its next job should carry
        self.vtime = 0.0  # fair queueing's virtual time (tokens): the start tag last served
        self.start_tag: dict[str, float] = {}  # backlogged owner -> virtual start tag of its next packet
        self.finish_tag: dict[str, float] = {}  # owner -> virtual finish tag of its last packet
        self.waiters: dict[str, asyncio.Future[Outcome]] = {}
        self.owners: dict[str, str] = {}  # request_id -> owner, while the job is queued or running
        self.jobs: dict[str, Job] = {}  # request_id -> job, while queued or running (client jobs only)
        self._listeners: dict[str, set[asyncio.Event]] = {}  # topic -> events set when one of its jobs finishes
        self._in_flight: Counter[str] = Counter()  # owner -> jobs queued or running
        self._sampling: Counter[str] = Counter()  # owner -> sample jobs queued or running
        self.shares = DeviceShares()  # device time of training turns vs sampling slices, per key
        self.clock = clock  # what turns are timed with (tests pass one that the fake work advances)
        self._turn: dict[str, int] = {}  # owner -> when it last had a single job run (turn taking)
        self._deferred = False  # the last training turn ran a chunk before the single jobs
        self._turns = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats = {"chunks": 0, "singles": 0, "jobs": 0, "max_chunk_owners": 0, "seq_gaps_skipped": 0,
                      "optimizer_steps_together": 0}
        # Set once the device has failed (see device_faults): no more work runs; /healthz says why.
        self.fault: str | None = None
        # Called on the event loop with every finished job and its outcome (metrics); must be cheap.
        self.observers: list[Callable[[Job, Outcome], None]] = []

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
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
        if job.request_id not in self.owners:
            self._in_flight[job.owner] += 1
            if job.kind == "sample":
                self._sampling[job.owner] += 1
        self.owners[job.request_id] = job.owner
        if not job.internal:
            self.jobs[job.request_id] = job
        if self.fault is not None:  # nothing can run any more: answer at once
            out = self._fault_outcome()
            self._persist([job], [out])
            self._finish([job], [out])
            return
        if job.kind == "sample":
            self.ops.sample_submit(job)
        else:  # every other kind belongs to a training run
            assert job.model_id is not None, f"{job.kind} job without a model"
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

    def cancel(self, request_id: str, *, known_sample: bool = False) -> bool:
        """Ask for a queued or running sample job to be dropped; False if there is none.

        The job then finishes like any other (persisted as failed with a cancellation error,
        waiters answered), at the latest after the sampler's next decode step.
        ``known_sample``: the caller read a pending sample request of this id from the store, so
        a job the engine does not hold yet (its submission is between storing and queueing) is
        still dropped when it arrives.
        """
        job = self.jobs.get(request_id)
        if (job is None and not known_sample) or (job is not None and job.kind != "sample"):
            return False
        self.ops.sample_cancel(request_id)
        self._wake.set()
        return True

    def listen(self, topic: str) -> asyncio.Event:
        """An event set the next time a job of ``topic`` finishes (its outcome already persisted).
        Register before reading the store, so a finish in between is never missed; ``unlisten`` after."""
        event = asyncio.Event()
        self._listeners.setdefault(topic, set()).add(event)
        return event

    def unlisten(self, topic: str, event: asyncio.Event) -> None:
        events = self._listeners.get(topic)
        if events is not None:
            events.discard(event)
            if not events:
                del self._listeners[topic]

    def owner_of(self, request_id: str) -> str | None:
        return self.owners.get(request_id)

    def in_flight(self, owner: str) -> int:
        """How many of ``owner``'s jobs are queued or running (for per-key limits)."""
        return self._in_flight.get(owner, 0)

    def queue_depth(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def queued_jobs(self) -> list[Job]:
        """Every training-run job waiting in a queue (not sample jobs, which the sampler queues).

        Safe to call from another thread (a metrics scrape): it copies before it reads.
        """
        return [j for q in list(self.queues.values()) for j in list(q)]

    def in_flight_total(self) -> int:
        """Jobs queued or running, every key together."""
        return sum(list(self._in_flight.values()))

    def queue_view(self) -> list[dict[str, Any]]:
        """Every request queued or running, oldest first: kind, run, owner, state and age.

        No payloads. ``state`` is ``queued`` (waiting its turn in its run's queue), ``running``
        (claimed by the worker) or ``sampling`` (with the samplers, queued or decoding).
        Called on the event loop, which owns these structures.
        """
        now = time.monotonic()
        queued = {id(j) for q in self.queues.values() for j in q}
        view = []
        for job in self.jobs.values():
            state = "sampling" if job.kind == "sample" else "queued" if id(job) in queued else "running"
            view.append({"request_id": job.request_id, "kind": job.kind, "model_id": job.model_id,
                         "owner": job.owner, "state": state, "age_s": round(now - job.enqueued_at, 3)})
        view.sort(key=lambda e: -e["age_s"])
        return view

    # ----------------------------------------------------------------------------- what is ready
    def _ready_head(self, model_id: str, now: float) -> Job | None:
        """The model's next job if it may run now: the model is idle and no earlier seq_id is
        still on its way (or the gap has been waited out)."""
        q = self.queues.get(model_id)
        if not q or model_id in self.busy_models:
            return None
        job = q[0]
        expected = self.next_seq.get(model_id)
        if (job.seq_id is None or expected is None or job.seq_id <= expected
                or now - job.enqueued_at >= self.seq_gap_wait_s):
            return job
        return None

    def _ready_heads(self) -> list[Job]:
        now = time.monotonic()
        return [j for j in (self._ready_head(m, now) for m in list(self.queues)) if j is not None]

    def _next_gap_deadline(self) -> float | None:
        """Seconds until a held-back head may run anyway (None if nothing is held back).

        A head that has become ready since the caller looked counts as 0: the wait for a gap
        ends exactly at the moment the head turns ready, so the caller's view and this one may
        fall on either side of it, and sleeping without a deadline then would strand the job.
        """
        now, soonest = time.monotonic(), None
        for m, q in self.queues.items():
            if q and m not in self.busy_models:
                left = 0.0 if self._ready_head(m, now) else q[0].enqueued_at + self.seq_gap_wait_s - now
                soonest = left if soonest is None else min(soonest, left)
        return None if soonest is None else max(0.0, soonest)

    def _has_training_work(self) -> bool:
        return bool(self.passes) or bool(self._ready_heads())

    # ----------------------------------------------------------------------------- dispatch
    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.fault is not None and (self.queues or self.passes or self.ops.sample_has_work()):
                pairs = self._fail_everything_queued()
                await loop.run_in_executor(None, self._persist, [j for j, _ in pairs], [o for _, o in pairs])
                self._finish([j for j, _ in pairs], [o for _, o in pairs])
                continue
            sampling = self.ops.sample_has_work()
            turn = self.shares.next(self._has_training_work(), sampling)
            if turn is None:
                self._wake.clear()
                gap = self._next_gap_deadline()
                try:
                    await asyncio.wait_for(self._wake.wait(), gap)
                except asyncio.TimeoutError:
                    pass
                continue
            started = self.clock()
            if turn == "sample":
                keys = len(self._sampling)
                await self._sampling_turn(loop)
                self.shares.charge("sample", self.clock() - started, keys)
                await asyncio.sleep(0)  # let submissions in between slices
                continue
            keys = len(self._training_keys())
            await self._training_turn(loop, settle=sampling)
            self.shares.charge("train", self.clock() - started, keys)
            await asyncio.sleep(0)

    def _training_keys(self) -> set[str]:
        """API keys with training work: a pass running, or a job queued."""
        return {p.owner for p in self.passes} | {q[0].owner for q in self.queues.values() if q}

    async def _training_turn(self, loop: asyncio.AbstractEventLoop, settle: bool) -> None:
        """The ready single jobs, then one chunk of the running passes. ``settle``: sampling waits
        for the next turn, so the device's queued training work is waited for before the turn
        ends (else the sampling slice's first read-back would wait for it, and be charged)."""
        # A key that was idle goes ahead of the busy keys' other jobs by one chunk, at most
        # one chunk in a row (else a stream of newcomers could hold those jobs back).
        self._deferred = not self._deferred and self._idle_key_waits()
        singles = [] if self._deferred else self._claim_singles()
        if singles:
            outcomes = await self._in_executor(loop, self._run_singles, singles)
            self._finish(singles, outcomes)
        self._claim_passes()
        ran = bool(singles or self.passes)
        if self.passes:
            passes = list(self.passes)
            try:
                finished = await loop.run_in_executor(self.executor, self._run_chunk, passes, loop)
            except Exception as exc:  # the chunk machinery itself failed: fail its passes, keep serving
                log.exception("training chunk failed")
                left = [p for p in passes if p in self.passes]
                finished = [(p, [Outcome.failure(exc) for _ in p.jobs]) for p in left]
                await loop.run_in_executor(None, self._persist, [j for p in left for j in p.jobs],
                                           [o for _, outs in finished for o in outs])
            for p, outcomes in finished:
                self._finish_pass(p, outcomes)
        if settle and ran:
            try:
                await loop.run_in_executor(self.executor, self.ops.device_settle)
            except Exception:  # a failed device shows in the next call that uses it
                log.exception("waiting for the device failed")

    async def _in_executor(self, loop, fn, jobs: list[Job]) -> list[Outcome]:
        try:
            return await loop.run_in_executor(self.executor, fn, jobs)
        except Exception as exc:  # the executor itself failed: fail the jobs, keep serving
            log.exception("worker call failed")
            outcomes = [Outcome.failure(exc) for _ in jobs]
            await loop.run_in_executor(None, self._persist, jobs, outcomes)
            return outcomes

    async def _sampling_turn(self, loop) -> None:
        try:
            pairs = await loop.run_in_executor(self.executor, self._sample_slice)
        except Exception as exc:  # fail what the sampler held, rather than leave it hanging
            log.exception("sampling step failed")
            pairs = [(j, Outcome.failure(exc)) for j in self.ops.sample_abort()]
            await loop.run_in_executor(None, self._persist, [j for j, _ in pairs], [o for _, o in pairs])
        self._finish([j for j, _ in pairs], [o for _, o in pairs])

    def _sample_slice(self) -> list[tuple[Job, Outcome]]:
        pairs = self.ops.sample_step(self.sampling_slice_s)
        self._persist([j for j, _ in pairs], [o for _, o in pairs])
        return pairs

    # ----------------------------------------------------------------------------- claiming (event loop)
    def _claim(self, job: Job) -> None:
        self.busy_models.add(job.model_id)
        self.queues[job.model_id].remove(job)
        if job.seq_id is not None:
            expected = self.next_seq.get(job.model_id)
            if expected is not None and job.seq_id > expected:
                self.stats["seq_gaps_skipped"] += 1  # waited seq_gap_wait_s for a predecessor in vain
                log.warning("model %s (key %s): ran %s seq_id %d without seq_id %d after holding it back %.1f s "
                            "(--seq-gap-wait-s); the earlier request never arrived (refused or lost on the way)",
                            job.model_id, key_id(job.owner), job.kind, job.seq_id, expected,
                            time.monotonic() - job.enqueued_at)
            self.next_seq[job.model_id] = max(expected or 0, job.seq_id + 1)

    def _idle_key_waits(self) -> bool:
        """Whether a key that was idle (no forward/backward of its own running or in the last
        chunk's fair queue) has one ready while other jobs (optimizer steps, checkpoints) wait
        too. Those run between chunks; run first, they would make the idle key's small request
        wait for every busy key's optimizer step on top of the chunk (what a shared server
        promises an idle key: its request within about one chunk of its quiet latency)."""
        heads = self._ready_heads()
        if not any(j.kind not in BATCHED_KINDS for j in heads):
            return False
        running = {p.owner for p in self.passes}
        return any(j.kind in BATCHED_KINDS and j.owner not in running and j.owner not in self.start_tag
                   for j in heads)

    def _claim_singles(self) -> list[Job]:
        """Every ready job that is not forward/backward, keys taking turns (least recently served
        first); the server's own jobs (unloading a finished session's runs) go first, since they
        free room that the others may need."""
        ready = [j for j in self._ready_heads() if j.kind not in BATCHED_KINDS]
        ready.sort(key=lambda j: (not j.internal, self._turn.get(j.owner, -1), j.order))
        for j in ready:
            self._claim(j)
            self._turn[j.owner] = next(self._turns)
        return ready

    def _claim_passes(self) -> None:
        """Start a pass for every ready model whose head is forward/backward: its consecutive
        forward/backward jobs (they commute) run as one pass."""
        for head in self._ready_heads():
            if head.kind not in BATCHED_KINDS:
                continue
            jobs = []
            for j in self.queues[head.model_id]:
                if j.kind not in BATCHED_KINDS:
                    break
                jobs.append(j)
            for j in jobs:
                self._claim(j)
            self.passes.append(_Pass(head.model_id, head.owner, jobs))

    # ----------------------------------------------------------------------------- execution (executor thread)
    def _run_singles(self, jobs: list[Job]) -> list[Outcome]:
        """Each job in turn; several runs' optimizer steps (tenants stepping in lockstep) as one
        call where the first of them stands, so that they share the device's round trips."""
        t0 = time.perf_counter()
        steps = [j for j in jobs if j.kind == "optim_step"]
        together = steps if len(steps) > 1 else []
        done: dict[int, Outcome] = {}
        for job in jobs:
            if id(job) in done:
                continue
            if together and job is together[0]:
                for j in together:
                    j.started_at = time.monotonic()
                try:
                    got = self.ops.run_optim_steps(together)
                except Exception as exc:
                    got = [exc] * len(together)
                outs = [g if isinstance(g, Outcome) else self._failed(j, g) for j, g in zip(together, got)]
                self._persist(together, outs)
                done.update((id(j), o) for j, o in zip(together, outs))
                continue
            job.started_at = time.monotonic()
            try:
                out = self.ops.run_one(job)
            except Exception as exc:
                out = self._failed(job, exc)
            self._persist([job], [out])
            done[id(job)] = out
        outcomes = [done[id(j)] for j in jobs]
        self.stats["singles"] += len(jobs)
        self.stats["optimizer_steps_together"] += len(together)
        log.debug("ran %d single jobs in %.1f ms", len(jobs), 1000 * (time.perf_counter() - t0))
        return outcomes

    @staticmethod
    def _failed(job: Job, exc: Exception) -> Outcome:
        if not isinstance(exc, TinsmithError):
            log.error("%s failed", job.kind, exc_info=exc)
        return Outcome.failure(exc)

    def _run_chunk(self, passes: list[_Pass], loop: asyncio.AbstractEventLoop) -> list[tuple[_Pass, list[Outcome]]]:
        """Begin new passes, run one chunk of tokens shared fairly among keys, and persist the
        outcomes of the passes that finished. A pass that completes midway is answered at once
        (its futures resolve while the rest of the chunk still runs)."""
        t0 = time.perf_counter()
        finished: list[tuple[_Pass, list[Outcome]]] = []
        answered: set[int] = set()
        live = []
        for p in passes:
            if p.handle is None:
                now = time.monotonic()
                for j in p.jobs:
                    j.started_at = now
                try:
                    p.handle = self.ops.train_begin(p.jobs)
                except Exception as exc:
                    if not isinstance(exc, TinsmithError):
                        log.exception("forward_backward failed to start")
                    outcomes = [Outcome.failure(exc) for _ in p.jobs]
                    self._persist(p.jobs, outcomes)
                    finished.append((p, outcomes))
                    continue
            live.append(p)
        quotas, budget = self._quotas([p for p in live if not self.ops.train_done(p.handle)])
        by_handle = {id(p.handle): p for p in live}

        def answer_now(handle: Any) -> None:
            p = by_handle[id(handle)]
            outcomes = self.ops.train_outcomes(handle, p.jobs)
            self._persist(p.jobs, outcomes)
            answered.add(id(p))
            loop.call_soon_threadsafe(self._finish_pass, p, outcomes)

        if quotas:
            ran = self.ops.train_advance([(p.handle, q) for p, q in quotas], budget, answer_now)
            for (p, quota), tokens in zip(quotas, ran):
                if quota > tokens and p.owner in self.finish_tag:  # what the worker could not run is not charged
                    self.finish_tag[p.owner] -= quota - tokens
                    if p.owner in self.start_tag:
                        self.start_tag[p.owner] -= quota - tokens
            self.stats["chunks"] += 1
            log.debug("chunk: %d tokens of %d keys in %.1f ms (%d passes, %d answered early)", sum(ran),
                      len({p.owner for (p, _), t in zip(quotas, ran) if t}), 1000 * (time.perf_counter() - t0),
                      len(quotas), len(answered))
            self.stats["max_chunk_owners"] = max(self.stats["max_chunk_owners"],
                                                 len({p.owner for (p, _), t in zip(quotas, ran) if t}))
        for p in live:
            if id(p) not in answered and self.ops.train_done(p.handle):
                outcomes = self.ops.train_outcomes(p.handle, p.jobs)
                self._persist(p.jobs, outcomes)
                finished.append((p, outcomes))
        return finished

    def _quotas(self, passes: list[_Pass]) -> tuple[list[tuple[_Pass, int]], int]:
        """Fill one chunk by weighted fair queueing over tokens, keys being the flows.

        A key's *packet* is a run of its pass's next datums, whole, up to a chunk of tokens
        (contiguous, so each micro-batch holds few adapters and the multi-LoRA matmuls stay
        few). A key that becomes backlogged gets the start tag ``max(V, its last finish tag)``
        (``V``: the start tag last served); each packet it sends then starts where its previous
        one finished, and the packet that would *finish* first goes next, as far as the chunk
        has room. So busy keys get the same tokens over time whatever
        their datum sizes or number of runs (a key's passes take turns); a key that was idle
        starts at ``V`` with no credit hoarded, and its small request finishes ahead of the
        larger packets of keys that start with it, in the very next chunk. The first datum of
        a chunk may exceed the chunk, so a datum longer than a chunk still runs. Returns each
        pass's tokens in the order granted, and the chunk's size.
        """
        budget = max(1, self.ops.train_chunk_tokens(len({p.owner for p in passes})))
        heads = {id(p): deque(self.ops.train_pending(p.handle, budget)) for p in passes}
        by_owner: dict[str, deque[_Pass]] = {}
        for p in passes:
            if heads[id(p)]:
                by_owner.setdefault(p.owner, deque()).append(p)
        for o in list(self.start_tag):
            if o not in by_owner:  # no longer backlogged: its next packet gets a new start tag
                del self.start_tag[o]
        for o in list(self.finish_tag):
            if o not in by_owner and self.finish_tag[o] <= self.vtime:
                del self.finish_tag[o]
        for o in by_owner:  # newly backlogged keys start now, or where their last packet finished
            self.start_tag.setdefault(o, max(self.vtime, self.finish_tag.get(o, self.vtime)))
        alloc: dict[int, int] = {}
        order: list[_Pass] = []
        total = 0

        def packet(p: _Pass) -> int:
            """Tokens of the pass's next packet that the chunk has room for (0: none)."""
            size = 0
            for n in heads[id(p)]:
                if (size and size + n > budget) or (total + size + n > budget and total + size > 0):
                    break
                size += n
            return size

        while True:
            best = None  # (finish tag, start tag, owner, pass, size)
            for o, mine in by_owner.items():
                start = self.start_tag[o]
                for _ in range(len(mine)):  # the key's passes take turns: the first that fits
                    size = packet(mine[0])
                    if size:
                        if best is None or start + size < best[0]:
                            best = (start + size, start, o, mine[0], size)
                        break
                    mine.rotate(-1)
            if best is None:
                break
            finish, start, o, p, size = best
            taken = 0
            while taken < size:
                taken += heads[id(p)].popleft()
            total += taken
            by_owner[o].rotate(-1)
            self.vtime = max(self.vtime, start)
            self.finish_tag[o] = self.start_tag[o] = finish
            if id(p) not in alloc:
                alloc[id(p)] = 0
                order.append(p)
            alloc[id(p)] += taken
        return [(p, alloc[id(p)]) for p in order], budget

    def _fault_outcome(self) -> Outcome:
        return Outcome(error=f"the server's device failed ({self.fault}) and can run no more work until the "
                             "server is restarted; saved checkpoints and the database are intact, state held "
                             "only in memory is lost", category="server")

    def _note_device_fault(self, fault: str) -> None:
        if self.fault is None:
            self.fault = fault
            log.error("the device failed: %s. No more work will run; restart the server (saved checkpoints "
                      "and the database are intact). /healthz now reports it.", fault)

    def _fail_everything_queued(self) -> list[tuple[Job, Outcome]]:
        """After a device fault: every queued job, pass and sample, failed with the reason."""
        jobs = [j for q in self.queues.values() for j in q]
        self.queues.clear()
        jobs += [j for p in self.passes for j in p.jobs]
        self.passes.clear()
        try:
            jobs += self.ops.sample_abort()
        except Exception:  # the sampler's own clean-up may touch the dead device
            log.exception("dropping the sampler's work after the device failed")
        return [(j, self._fault_outcome()) for j in jobs]

    def _persist(self, jobs: list[Job], outcomes: list[Outcome]) -> None:
        """Store the outcomes of client jobs, all in one transaction (a sampling slice finishes
        many requests at once); if that fails, one at a time, so that one bad outcome costs no
        other its record. Notes a device fault reported by any of them."""
        now, wall = time.monotonic(), datetime.now(timezone.utc)
        stored: list[RequestOutcome] = []
        for job, out in zip(jobs, outcomes):
            job.finished_at = now
            if out.device_fault is not None:
                self._note_device_fault(out.device_fault)
            if job.internal:
                if out.error is not None:
                    log.warning("internal %s for %s failed: %s", job.kind, job.model_id, out.error)
                continue
            # When it left the queue, in UTC as the store keeps times: arrival, start and end on one record.
            started = None if job.started_at is None else wall - timedelta(seconds=now - job.started_at)
            stored.append(RequestOutcome(job.request_id, out.result or b"{}", out.content_type,
                                         metric_point=out.metric_point, started_at=started) if out.error is None
                          else RequestOutcome(job.request_id, error=out.error, category=out.category,
                                              started_at=started))
        if not stored:
            return
        try:
            self.sink.finish_requests(stored)
            return
        except Exception:
            if len(stored) == 1:
                log.exception("could not persist the outcome of %s", stored[0].request_id)
                return
            log.exception("could not persist %d outcomes together; trying one at a time", len(stored))
        for o in stored:
            try:
                self.sink.finish_requests([o])
            except Exception:
                log.exception("could not persist the outcome of %s", o.request_id)

    def _finish_pass(self, p: _Pass, outcomes: list[Outcome]) -> None:
        if p in self.passes:
            self.passes.remove(p)
            self._finish(p.jobs, outcomes)

    def _finish(self, jobs: list[Job], outcomes: list[Outcome]) -> None:
        if not jobs:
            return
        self.stats["jobs"] += len(jobs)
        for job, out in zip(jobs, outcomes):
            if job.model_id is not None and job.kind != "sample":
                self.busy_models.discard(job.model_id)
                if not self.queues.get(job.model_id):
                    self.queues.pop(job.model_id, None)
                if job.kind == "unload_model" and out.error is None:
                    self.next_seq.pop(job.model_id, None)
            self.jobs.pop(job.request_id, None)
            if job.kind == "sample":
                self.ops.sample_forget(job.request_id)
            if job.topic is not None:
                for event in self._listeners.get(job.topic, ()):
                    event.set()
            owner = self.owners.pop(job.request_id, None)
            if owner is not None:
                _discount(self._in_flight, owner)
                if job.kind == "sample":
                    _discount(self._sampling, owner)
            w = self.waiters.pop(job.request_id, None)
            if w is not None and not w.done():
                w.set_result(out)
            for observe in self.observers:
                try:
                    observe(job, out)
                except Exception:  # an observer's bug must never stall the engine
                    log.exception("observer of finished jobs failed")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s of %s (key %s) answered %.1f ms after it was queued", job.kind, job.model_id,
                          key_id(job.owner), 1000 * (time.monotonic() - job.enqueued_at))
        self._wake.set()


def _discount(counts: Counter[str], owner: str) -> None:
    """One job of ``owner`` less in ``counts`` (an owner with none left leaves it)."""
    counts[owner] -= 1
    if counts[owner] <= 0:
        del counts[owner]
