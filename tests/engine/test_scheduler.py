"""The engine's scheduling, against operations that only count tokens (no model).

What must hold: a model's jobs run in seq_id order even when they arrive out of order (held
back until the gap fills or times out); a key with a huge forward_backward gets its fair share
of each chunk and no more, so other keys' small requests, optimizer steps and checkpoint saves
finish while the huge one is still running.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
import time
from dataclasses import dataclass, field

import pytest

from tinsmith.engine.scheduler import Engine, Job, Outcome

CHUNK = 100  # tokens per chunk


@dataclass
class FakePass:
    jobs: list[Job]
    todo: list[int]  # datum lengths still to run
    done: bool = False


@dataclass
class FakeOps:
    """Forward/backward jobs carry their datum lengths as ``args``; everything is logged."""

    chunk_delay_s: float = 0.0
    log: list[tuple] = field(default_factory=list)  # ("chunk", {model: tokens}) / ("single", kind, model)
    chunk_cost_s: float = 0.0  # what a chunk advances ``now`` by (the engine's clock in share tests)
    now: float = 0.0
    settles: int = 0

    def run_one(self, job: Job) -> Outcome:
        self.log.append(("single", job.kind, job.model_id))
        return Outcome(result=b"{}")

    def run_optim_steps(self, jobs: list[Job]) -> list:
        """Jobs whose args say "refuse" get an error of their own."""
        self.log.append(("together", [j.model_id for j in jobs]))
        return [ValueError(f"refused {j.model_id}") if j.args == "refuse" else Outcome(result=b"{}") for j in jobs]

    def train_begin(self, jobs: list[Job]) -> FakePass:
        self.log.append(("begin", jobs[0].model_id, [j.seq_id for j in jobs]))
        return FakePass(jobs, [n for j in jobs for n in j.args])

    def train_advance(self, quotas: list[tuple[FakePass, int]], budget: int, on_done) -> list[int]:
        """The worker's rule: datums that fit the pass's quota and the chunk budget, and the
        first datum of a call whatever its length."""
        time.sleep(self.chunk_delay_s)
        self.now += self.chunk_cost_s
        ran, by_model, total = [], {}, 0
        for p, quota in quotas:
            taken = 0
            while p.todo and ((taken + p.todo[0] <= quota and total + p.todo[0] <= budget) or total == 0):
                taken += p.todo[0]
                total += p.todo.pop(0)
            p.done = not p.todo
            if p.done and 0 < taken <= 20:  # small passes answer at once, like small micro-batches
                on_done(p)
            ran.append(taken)
            if taken:
                by_model[p.jobs[0].model_id] = taken
        self.log.append(("chunk", by_model))
        assert total <= budget or len([t for t in ran if t]) == 1, "a chunk keeps to its budget"
        return ran

    def train_pending(self, p: FakePass, tokens: int) -> list[int]:
        out = []
        for n in p.todo:
            if sum(out) >= tokens:
                break
            out.append(n)
        return out

    def train_done(self, p: FakePass) -> bool:
        return p.done or not p.todo

    def train_outcomes(self, p: FakePass, jobs: list[Job]) -> list[Outcome]:
        return [Outcome(result=b"{}") for _ in jobs]

    def train_chunk_tokens(self, keys: int) -> int:
        return CHUNK

    def sample_submit(self, job: Job) -> None:
        raise AssertionError("no sampling here")

    def sample_has_work(self) -> bool:
        return False

    def sample_step(self, budget_s: float):
        return []

    def sample_cancel(self, request_id: str) -> None:
        pass

    def sample_forget(self, request_id: str) -> None:
        pass

    def sample_abort(self):
        return []

    def device_settle(self) -> None:
        self.settles += 1

    def clock(self) -> float:
        return self.now


class NullSink:
    def finish_requests(self, outcomes):
        return [True] * len(outcomes)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _engine(ops: FakeOps, **kw) -> Engine:
    engine = Engine(ops, NullSink(), **kw)
    await engine.start()
    return engine


def waiting(engine: Engine, *request_ids: str, timeout: float = 20) -> list[asyncio.Task]:
    """Start waiting at once: a job's waiter is dropped when it finishes, so wait before it can."""
    return [asyncio.ensure_future(engine.wait(r, timeout)) for r in request_ids]


def fb(rid: str, model: str, seq: int, lengths: list[int], owner: str = "a", kind: str = "forward_backward") -> Job:
    return Job(rid, kind, model, seq, lengths, owner=owner)


def test_out_of_order_jobs_wait_for_their_predecessor_and_run_as_one_pass():
    async def scenario():
        ops = FakeOps()
        engine = await _engine(ops, seq_gap_wait_s=5.0)
        engine.submit(Job("c", "create_model", "m", 0, None, owner="a"))
        await waiting(engine, "c")[0]
        # The SDK sends the chunks of one large call concurrently, the first one last.
        for seq in (3, 2):
            engine.submit(fb(f"fb{seq}", "m", seq, [10]))
        engine.submit(Job("opt", "optim_step", "m", 4, None, owner="a"))
        (opt,) = waiting(engine, "opt")
        await asyncio.sleep(0.2)
        assert ops.log == [("single", "create_model", "m")], "seq 2 and 3 must wait for seq 1"
        engine.submit(fb("fb1", "m", 1, [10]))
        await opt
        await engine.stop()
        return ops.log

    log = run(scenario())
    assert log[1] == ("begin", "m", [1, 2, 3])  # all three chunks in one pass, in order
    assert log[-1] == ("single", "optim_step", "m")


def test_optimizer_steps_that_are_ready_together_run_as_one_call():
    """Three tenants' forward/backward passes share a chunk; their optim_steps, ready together,
    go to the worker in one call (which steps them together), each answered on its own, one
    refused alone; a lone optim_step later runs by itself."""
    async def scenario():
        ops = FakeOps()
        engine = await _engine(ops)
        for m in "abc":
            engine.submit(fb(f"fb-{m}", m, 1, [10], owner=m))
            engine.submit(Job(f"opt-{m}", "optim_step", m, 2, "refuse" if m == "b" else None, owner=m))
        outcomes = await asyncio.gather(*waiting(engine, "opt-a", "opt-b", "opt-c"))
        engine.submit(fb("fb-a2", "a", 3, [10], owner="a"))
        engine.submit(Job("opt-a2", "optim_step", "a", 4, None, owner="a"))
        (alone,) = await asyncio.gather(*waiting(engine, "opt-a2"))
        await engine.stop()
        return ops.log, outcomes, alone, engine.stats

    log, outcomes, alone, stats = run(scenario())
    assert ("together", ["a", "b", "c"]) in log, log
    assert [o.error is None for o in outcomes] == [True, False, True]
    assert "refused b" in str(outcomes[1].error)
    assert alone.error is None and log[-1] == ("single", "optim_step", "a")
    assert stats["optimizer_steps_together"] == 3


def test_an_idle_keys_request_goes_ahead_of_busy_keys_optimizer_steps_by_one_chunk():
    """Two busy keys' passes finish in a chunk and their optim_steps are ready; an idle key's small
    forward/backward arrived meanwhile. It runs in the next chunk, before those steps (else it
    would wait for every busy key's step on top of the chunk), and the steps run right after it:
    never two chunks in a row ahead of them."""
    async def scenario():
        ops = FakeOps(chunk_delay_s=0.2)
        engine = await _engine(ops)
        engine.submit(fb("long", "big", 1, [CHUNK] * 4, owner="b"))
        for k in ("k1", "k2"):
            engine.submit(fb(f"fb-{k}", k, 1, [10], owner=k))
            engine.submit(Job(f"opt-{k}", "optim_step", k, 2, None, owner=k))
        await asyncio.sleep(0.05)  # the first chunk is running
        engine.submit(fb("probe", "p", 1, [5], owner="p"))
        await asyncio.gather(*waiting(engine, "probe", "opt-k1", "opt-k2", "long"))
        await engine.stop()
        return ops.log

    log = run(scenario())
    chunks = [entry for entry in log if entry[0] in ("chunk", "together")]
    assert {"k1", "k2"} <= set(chunks[0][1]), chunks
    assert chunks[1][0] == "chunk" and "p" in chunks[1][1], chunks  # the idle key, before the steps
    assert chunks[2] == ("together", ["k1", "k2"]), chunks  # and the steps before another chunk


def test_a_gap_that_never_fills_is_waited_out():
    async def scenario():
        ops = FakeOps()
        engine = await _engine(ops, seq_gap_wait_s=0.3)
        engine.submit(Job("c", "create_model", "m", 0, None))
        await waiting(engine, "c")[0]
        t0 = time.monotonic()
        engine.submit(fb("fb5", "m", 5, [10]))  # 1..4 never come (refused at the door, say)
        out = await waiting(engine, "fb5")[0]
        waited = time.monotonic() - t0
        engine.submit(fb("fb6", "m", 6, [10]))  # the next one is not held back again
        t1 = time.monotonic()
        await waiting(engine, "fb6")[0]
        await engine.stop()
        return out, waited, time.monotonic() - t1, engine.stats

    out, waited, next_wait, stats = run(scenario())
    assert out is not None and out.error is None
    assert 0.25 <= waited < 2.0
    assert next_wait < 0.2
    assert stats["seq_gaps_skipped"] == 1


def test_small_requests_of_other_keys_finish_while_a_huge_one_runs():
    async def scenario():
        ops = FakeOps(chunk_delay_s=0.002)
        engine = await _engine(ops)
        engine.submit(fb("huge", "big", 1, [50] * 200, owner="heavy"))  # 100 chunks worth
        await asyncio.sleep(0.02)
        arrived = sum(1 for entry in ops.log if entry[0] == "chunk")
        engine.submit(fb("small", "s", 1, [30, 30], owner="light"))
        engine.submit(Job("save", "save_weights", "t", 1, None, owner="light2"))
        huge, small, save = waiting(engine, "huge", "small", "save")
        small, save = await small, await save
        still_running = engine.pending("huge")
        await huge
        await engine.stop()
        return small, save, still_running, arrived, ops.log

    small, save, still_running, arrived, log = run(scenario())
    assert small.error is None and save.error is None
    assert still_running, "the small request and the save must not wait for the huge pass"
    chunks = [c for kind, c, *rest in log if kind == "chunk"]
    first_small = next(i for i, c in enumerate(chunks) if c.get("s"))
    assert arrived > 0 and first_small - arrived <= 2, "the small request starts within a chunk or two of arriving"
    assert sum(c.get("s", 0) for c in chunks) == 60
    assert all(sum(c.values()) <= CHUNK for c in chunks), "every chunk keeps to its budget"
    assert sum(c.get("big", 0) for c in chunks[first_small - 1:first_small + 3]) > 0, "the huge one goes on meanwhile"


@dataclass
class SamplingOps(FakeOps):
    """FakeOps with a sampler: a sample job's ``args`` is how many slices it decodes for."""

    slices: dict = field(default_factory=dict)  # request_id -> slices left
    jobs_by_id: dict = field(default_factory=dict)
    slice_cost_s: float = 0.0  # what a slice advances ``now`` by

    def sample_submit(self, job: Job) -> None:
        self.slices[job.request_id] = job.args
        self.jobs_by_id[job.request_id] = job

    def sample_has_work(self) -> bool:
        return bool(self.slices)

    def sample_step(self, budget_s: float):
        time.sleep(self.chunk_delay_s)
        self.now += self.slice_cost_s
        self.log.append(("slice", sorted(self.slices)))
        done = []
        for rid in list(self.slices):
            self.slices[rid] -= 1
            if not self.slices[rid]:
                del self.slices[rid]
                done.append((self.jobs_by_id.pop(rid), Outcome(result=b"{}")))
        return done


def _turns(log: list[tuple]) -> list[str]:
    return [entry[0] for entry in log if entry[0] in ("chunk", "slice")]


def test_sampling_and_training_take_turns_so_both_go_on():
    """One key samples while another trains a long pass, a chunk taking as long as a slice:
    they alternate, so the sample finishes long before the pass, and the pass advances while
    the sample decodes (neither waits for the other to finish)."""
    async def scenario():
        ops = SamplingOps(chunk_delay_s=0.003, chunk_cost_s=1.0, slice_cost_s=1.0)
        engine = await _engine(ops, clock=ops.clock)
        engine.submit(fb("train", "m", 1, [CHUNK] * 40, owner="trainer"))  # 40 chunks
        await asyncio.sleep(0.02)
        engine.submit(Job("sample", "sample", "m2", None, 5, owner="sampler"))  # 5 slices
        (sampled,) = await asyncio.gather(*waiting(engine, "sample"))
        still_training = engine.pending("train")
        await asyncio.gather(*waiting(engine, "train"))
        await engine.stop()
        return sampled, still_training, ops.log

    sampled, still_training, log = run(scenario())
    assert sampled.error is None and still_training
    kinds = _turns(log)
    first, last = kinds.index("slice"), len(kinds) - 1 - kinds[::-1].index("slice")
    assert kinds[first:last + 1] == ["slice", "chunk"] * 4 + ["slice"]  # one chunk between slices
    assert kinds.count("chunk") == 40


def _shared(chunk_cost: float, slice_cost: float, trainers: int, samplers: int):
    """Trainers with long passes and samplers with long requests, all busy throughout; the
    engine's clock advances by each turn's cost. Returns the turns and the settles."""
    async def scenario():
        ops = SamplingOps(chunk_cost_s=chunk_cost, slice_cost_s=slice_cost)
        engine = await _engine(ops, clock=ops.clock)
        for t in range(trainers):
            engine.submit(fb(f"train{t}", f"m{t}", 1, [CHUNK // trainers] * 60, owner=f"trainer{t}"))
        for k in range(samplers):
            engine.submit(Job(f"sample{k}", "sample", f"s{k}", None, 10_000, owner=f"sampler{k}"))
        while sum(1 for e in ops.log if e[0] == "chunk") < 50:
            await asyncio.sleep(0.005)
        shares = dict(engine.shares.spent)
        await engine.stop()
        return _turns(ops.log), ops.settles, shares

    return run(scenario())


def test_the_device_is_shared_by_time_not_by_turns():
    """A training chunk takes four times a sampling slice: the sampling key gets four slices for
    each chunk, so both keys have the device half the time (strict turns gave the trainer 80%)."""
    kinds, settles, spent = _shared(chunk_cost=1.0, slice_cost=0.25, trainers=1, samplers=1)
    steady = kinds[kinds.index("slice"):]
    assert steady[:20] == (["slice"] * 4 + ["chunk"]) * 4, steady[:20]
    assert abs(spent["train"] - spent["sample"]) <= 1.0, spent
    assert settles >= 10, "the device is waited for before sampling's turns, so each turn pays its own"


def test_the_device_is_shared_per_key():
    """Three keys train and one samples, a chunk (which the three keys share) taking three times
    a slice: they alternate, so training has the device three quarters of the time, a quarter
    for each key (by time alone, the sampler would get half). And the other way round."""
    kinds, _, spent = _shared(chunk_cost=0.75, slice_cost=0.25, trainers=3, samplers=1)
    steady = kinds[kinds.index("slice"):][:16]
    assert steady == ["slice", "chunk"] * 8, steady
    assert 2.5 <= spent["train"] / spent["sample"] <= 3.5, spent
    kinds, _, spent = _shared(chunk_cost=0.25, slice_cost=0.75, trainers=1, samplers=3)
    steady = kinds[kinds.index("chunk"):][:16]
    assert steady == ["chunk", "slice"] * 8, steady
    assert 2.5 <= spent["sample"] / spent["train"] <= 3.5, spent


def _newcomer_turns(chunk_cost: float, slice_cost: float, slices: int) -> list[str]:
    """Training runs alone for ten chunks, then a sample of ``slices`` slices arrives: the turns
    from its first slice on."""
    async def scenario():
        ops = SamplingOps(chunk_cost_s=chunk_cost, slice_cost_s=slice_cost)
        engine = await _engine(ops, clock=ops.clock)
        engine.submit(fb("train", "m", 1, [CHUNK] * 60, owner="trainer"))
        while sum(1 for e in ops.log if e[0] == "chunk") < 10:
            await asyncio.sleep(0.002)
        engine.submit(Job("sample", "sample", "s", None, slices, owner="sampler"))
        await asyncio.gather(*waiting(engine, "sample", "train"))
        await engine.stop()
        return _turns(ops.log)

    kinds = run(scenario())
    return kinds[kinds.index("slice"):]


def test_a_kind_that_was_idle_gets_no_credit_for_it():
    """Training runs alone for a long time, then a sample arrives: it goes first once and then
    takes its share, rather than holding the device until its clock has caught up."""
    assert _newcomer_turns(0.25, 0.25, 6)[:11] == ["slice", "chunk"] * 5 + ["slice"]


def test_a_newcomer_is_not_owed_the_turn_it_arrived_in():
    """Training's chunks take four times a slice. A sample arriving while training runs alone is
    not owed the chunk that was running when it came: it goes first once, then the kinds share
    the time (a chunk, then as many slices as make up for it)."""
    want = ["slice", "chunk"] + ["slice"] * 3 + ["chunk"] + ["slice"] * 4 + ["chunk"]
    assert _newcomer_turns(1.0, 0.25, 20)[:11] == want


def test_a_key_with_long_sequences_gets_no_more_than_its_share():
    """Deficit round robin: 400-token datums against 20-token ones, both keys always busy."""
    async def scenario():
        ops = FakeOps()
        engine = await _engine(ops)
        engine.submit(fb("long", "L", 1, [400] * 20, owner="long"))
        engine.submit(fb("short", "S", 1, [20] * 400, owner="short"))
        await asyncio.gather(*waiting(engine, "long", "short"))
        await engine.stop()
        return ops.log

    log = run(scenario())
    chunks = [c for kind, c, *rest in log if kind == "chunk"]
    # While both were running, each key's tokens stay within one long datum of each other.
    last_short = max(i for i, c in enumerate(chunks) if "S" in c)
    assert sum(1 for c in chunks[:last_short] if "L" in c) >= 10, "the long datums interleave with the short ones"
    long_tokens = short_tokens = 0
    for c in chunks:
        long_tokens += c.get("L", 0)
        short_tokens += c.get("S", 0)
        if short_tokens < 8000 and long_tokens < 8000:
            assert abs(long_tokens - short_tokens) <= 400 + CHUNK, (long_tokens, short_tokens)


def test_one_keys_many_runs_share_one_keys_part():
    async def scenario():
        ops = FakeOps()
        engine = await _engine(ops)
        for i in range(4):
            engine.submit(fb(f"many{i}", f"m{i}", 1, [10] * 40, owner="many"))
        engine.submit(fb("one", "solo", 1, [10] * 40, owner="one"))
        await waiting(engine, "one")[0]
        counts = {"many": 0, "one": 0}
        for kind, c, *rest in ops.log:
            if kind == "chunk":
                counts["many"] += sum(v for m, v in c.items() if m.startswith("m"))
                counts["one"] += c.get("solo", 0)
        await engine.stop()
        return counts

    counts = run(scenario())
    # When the single-run key finished its 400 tokens, the four-run key had about as many.
    assert counts["one"] == 400
    assert 300 <= counts["many"] <= 500, counts


@pytest.mark.parametrize("kind", ["forward_backward", "forward"])
def test_a_failing_begin_fails_only_that_pass(kind):
    class Refusing(FakeOps):
        def train_begin(self, jobs):
            if jobs[0].model_id == "bad":
                raise ValueError("boom")
            return super().train_begin(jobs)

    async def scenario():
        ops = Refusing()
        engine = await _engine(ops)
        engine.submit(fb("bad", "bad", 1, [10], kind=kind))
        engine.submit(fb("good", "good", 1, [10], owner="b", kind=kind))
        bad, good = await asyncio.gather(*waiting(engine, "bad", "good"))
        await engine.stop()
        return bad, good

    bad, good = run(scenario())
    assert bad.error and "boom" in bad.error and good.error is None


def test_a_key_that_was_idle_goes_first_in_the_next_chunk():
    """Four keys fill every chunk exactly; a newcomer's small request must not queue behind them."""
    async def scenario():
        ops = FakeOps(chunk_delay_s=0.003)
        engine = await _engine(ops)
        for i in range(4):
            engine.submit(fb(f"busy{i}", f"b{i}", 1, [25] * 400, owner=f"busy{i}"))
        waits = waiting(engine, *[f"busy{i}" for i in range(4)])
        await asyncio.sleep(0.05)
        arrived = sum(1 for entry in ops.log if entry[0] == "chunk")
        engine.submit(fb("new", "n", 1, [10], owner="newcomer"))
        await waiting(engine, "new")[0]
        await asyncio.gather(*waits)
        await engine.stop()
        return arrived, [c for kind, c, *rest in ops.log if kind == "chunk"]

    arrived, chunks = run(scenario())
    first = next(i for i, c in enumerate(chunks) if "n" in c)
    assert arrived > 0 and first - arrived <= 1, (arrived, first)
    # and the four busy keys shared evenly throughout (within one packet: a chunk)
    totals = [sum(c.get(f"b{i}", 0) for c in chunks[: first + 20]) for i in range(4)]
    assert max(totals) - min(totals) <= CHUNK, totals


def test_a_head_turning_ready_while_the_engine_looks_is_not_stranded(monkeypatch):
    """The engine wakes exactly when a held-back head's gap wait ends; if it finds the head
    still held and then asks for the next deadline a moment later, the answer must be "now",
    not "nothing is held" (which would put it to sleep with the job stranded)."""
    import tinsmith.engine.scheduler as sched

    engine = Engine(FakeOps(), NullSink(), seq_gap_wait_s=2.0)
    engine.next_seq["m"] = 1
    job = fb("late", "m", 5, [10])
    job.enqueued_at = 100.0
    engine.queues["m"] = [job]
    clock = iter([101.9999999, 102.0000001])
    monkeypatch.setattr(sched.time, "monotonic", lambda: next(clock))
    assert not engine._has_training_work()  # still held at the first look
    assert engine._next_gap_deadline() == 0.0  # ready at the second: run now


def test_queue_view_lists_queued_and_running_jobs_without_payloads():
    async def go():
        engine = Engine(FakeOps(), NullSink())  # not started: everything stays queued
        engine.submit(fb("r1", "m1", 1, [5], owner="a"))
        engine.submit(fb("r2", "m2", 1, [5], owner="b"))
        engine.submit(Job("r3", "unload_model", "m1", None, None, owner="a", internal=True))
        view = engine.queue_view()
        assert {(e["request_id"], e["owner"], e["state"], e["kind"]) for e in view} == {
            ("r1", "a", "queued", "forward_backward"), ("r2", "b", "queued", "forward_backward")}
        assert all(set(e) == {"request_id", "kind", "model_id", "owner", "state", "age_s"} for e in view)
        engine._claim(engine.queues["m1"][0])
        assert {e["request_id"]: e["state"] for e in engine.queue_view()}["r1"] == "running"
        engine._finish([engine.jobs["r1"]], [Outcome(result=b"{}")])
        assert [e["request_id"] for e in engine.queue_view()] == ["r2"]

    run(go())


class _DeviceLost(RuntimeError):
    pass


@pytest.mark.parametrize("error", [
    _DeviceLost("CUDA error: an illegal memory access was encountered"),
    type("AcceleratorError", (RuntimeError,), {})("device-side failure"),
])
def test_a_failed_device_stops_the_work_and_every_request_says_why(error):
    """The device fails in one model's step: that request fails with the device's error, queued
    work and later submissions fail at once naming the fault, and the engine reports it."""
    class Failing(FakeOps):
        def train_begin(self, jobs):
            if jobs[0].model_id == "dies":
                raise error
            return super().train_begin(jobs)

    class Recording(NullSink):
        failed: dict[str, str] = {}

        def finish_requests(self, outcomes):
            self.failed.update({o.request_id: o.error for o in outcomes if o.error is not None})
            return [True] * len(outcomes)

    async def scenario():
        ops, sink = Failing(chunk_delay_s=0.01), Recording()
        engine = Engine(ops, sink)
        await engine.start()
        engine.submit(fb("first", "dies", 1, [10]))
        first = await waiting(engine, "first")[0]
        engine.submit(fb("later", "fine", 1, [10], owner="b"))  # answered at once: no waiter is left
        engine.submit(Job("single", "optim_step", "fine", 2, None, owner="b"))
        await asyncio.sleep(0.05)
        await engine.stop()
        return engine, first, sink.failed, ops

    engine, first, failed, ops = run(scenario())
    assert engine.fault is not None and type(error).__name__ in engine.fault
    assert "internal error" in first.error and first.device_fault and "first" in failed
    for rid in ("later", "single"):
        assert "device failed" in failed[rid] and "restarted" in failed[rid]
    assert not engine.jobs and not engine.queues and not engine.in_flight_total()
    assert not [e for e in ops.log if e[0] in ("chunk", "single") and "fine" in str(e)]


def test_out_of_memory_and_other_errors_are_not_device_faults():
    from tinsmith.engine.device_faults import device_fault

    assert device_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert device_fault(ValueError("bad shape")) is None
    assert device_fault(RuntimeError("CUDA error: unspecified launch failure")).startswith("RuntimeError: CUDA error")


class SlicedSampling(FakeOps):
    """Sample jobs finish together in the next slice; the one named ``bad`` fails."""

    def __init__(self):
        super().__init__()
        self.inbox: list[Job] = []

    def sample_submit(self, job: Job) -> None:
        self.inbox.append(job)

    def sample_has_work(self) -> bool:
        return bool(self.inbox)

    def sample_step(self, budget_s: float):
        done, self.inbox = self.inbox, []
        return [(j, Outcome(error="no", category="user") if j.request_id == "bad"
                 else Outcome(result=j.request_id.encode())) for j in done]


def test_a_slices_outcomes_are_stored_in_one_call_and_alone_when_that_fails():
    """The requests one sampling slice finishes are stored together; when storing them
    together fails, each is stored alone, so the others keep their records."""
    class Batches(NullSink):
        def __init__(self, broken: bool):
            self.calls: list[list[str]] = []
            self.broken = broken

        def finish_requests(self, outcomes):
            self.calls.append([o.request_id for o in outcomes])
            if self.broken and len(outcomes) > 1:
                raise RuntimeError("database hiccup")
            return [True] * len(outcomes)

    async def scenario(broken: bool):
        ops, sink = SlicedSampling(), Batches(broken)
        engine = Engine(ops, sink)
        for rid in ("a", "bad", "c"):  # queued before the engine runs: one slice takes all three
            engine.submit(Job(rid, "sample", None, None, None, owner="o"))
        futures = waiting(engine, "a", "bad", "c")
        await engine.start()
        outs = await asyncio.gather(*futures)
        await engine.stop()
        return sink.calls, outs

    calls, outs = run(scenario(False))
    assert calls == [["a", "bad", "c"]]
    assert [o.result for o in outs] == [b"a", None, b"c"] and outs[1].error == "no"
    calls, outs = run(scenario(True))
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    assert [o.result for o in outs] == [b"a", None, b"c"]


def test_stored_outcomes_say_when_their_work_began():
    """Each stored outcome carries the wall-clock time its job left the queue, so that a request's
    record holds its arrival, its start and its end (the wait apart from the work)."""
    class Recording(NullSink):
        def __init__(self):
            self.outcomes = []

        def finish_requests(self, outcomes):
            self.outcomes += outcomes
            return [True] * len(outcomes)

    async def scenario():
        ops, sink = FakeOps(), Recording()
        engine = Engine(ops, sink)
        await engine.start()
        before = datetime.now(timezone.utc)
        engine.submit(fb("fb", "m", 1, [10]))
        engine.submit(Job("opt", "optim_step", "m", 2, None, owner="a"))
        await asyncio.gather(*waiting(engine, "fb", "opt"))
        after = datetime.now(timezone.utc)
        await engine.stop()
        return sink.outcomes, before, after

    outcomes, before, after = run(scenario())
    started = {o.request_id: o.started_at for o in outcomes}
    assert set(started) == {"fb", "opt"}
    assert all(before <= t <= after for t in started.values()), (before, started, after)
    assert started["fb"] <= started["opt"]  # the step waited for the pass before it


def test_stopping_stores_the_outcomes_of_the_slice_that_was_running():
    """A slice under way when the engine stops still stores what it finished: the request is not
    left pending in the store (lost at the next start) for work that was done."""
    class Recording(NullSink):
        def __init__(self):
            self.ids: list[str] = []

        def finish_requests(self, outcomes):
            time.sleep(0.05)
            self.ids += [o.request_id for o in outcomes]
            return [True] * len(outcomes)

    async def scenario():
        ops, sink = SamplingOps(chunk_delay_s=0.2), Recording()  # a slice takes 0.2 s
        engine = Engine(ops, sink)
        engine.submit(Job("s", "sample", None, None, 1, owner="o"))
        await engine.start()
        await asyncio.sleep(0.05)  # inside the slice that finishes "s"
        await engine.stop()
        return sink.ids

    assert run(scenario()) == ["s"]
