"""A sampling slice split between several samplers (base models, whole-weight snapshots) by the
API keys each one serves."""

from __future__ import annotations

from types import SimpleNamespace

from tinsmith.server.operations import WorkerOperations


class RecordingSampler:
    """Holds rows of the given owners and records the time budget of each step."""

    def __init__(self, *owners: str):
        self.rows = [SimpleNamespace(state=SimpleNamespace(task=SimpleNamespace(owner=o))) for o in owners]
        self.inbox: list = []
        self.budgets: list[float] = []

    def has_work(self) -> bool:
        return bool(self.rows)

    def step(self, budget_s: float) -> list:
        self.budgets.append(budget_s)
        return []

    def running(self):
        return iter(())


def _slice(*samplers: RecordingSampler, budget_s: float = 0.06) -> None:
    worker = SimpleNamespace(samplers={i: s for i, s in enumerate(samplers)}, drop_idle_live_samplers=lambda: None,
                             refresh_live_copies=lambda: None)
    WorkerOperations(worker).sample_step(budget_s)


def test_a_slice_is_split_by_the_keys_each_sampler_serves():
    alone = RecordingSampler("key-a", "key-a", "key-a")  # one key, many rows: its own snapshot's sampler
    shared = RecordingSampler("key-b", "key-c", "key-d")  # three keys on the base model's sampler
    _slice(alone, shared)
    assert alone.budgets == [0.015] and shared.budgets == [0.045]


def test_queued_requests_count_their_keys_and_an_idle_sampler_gets_nothing():
    waiting = RecordingSampler("key-a")
    waiting.inbox = [SimpleNamespace(owner="key-b")]
    idle = RecordingSampler()
    single = RecordingSampler("key-c")
    _slice(waiting, idle, single)
    assert idle.budgets == [] and abs(waiting.budgets[0] - 0.04) < 1e-12 and abs(single.budgets[0] - 0.02) < 1e-12


def test_a_request_arriving_during_a_slice_ends_it_after_the_burst(qwen3_dir):
    """The engine hands sample requests to samplers between slices: one submitted while a slice
    decodes ends that slice after its burst (not after the slice's whole time budget), so the
    next slice takes it in."""
    import torch

    from tests.sampling.conftest import decoder, fresh_model, task
    from tinsmith.sampling.sampler import Sampler

    sampler = Sampler(fresh_model(qwen3_dir), decoder(qwen3_dir), decode_burst=2, max_rows=4)
    busy = SimpleNamespace(args=SimpleNamespace(progress=None, snapshot_key=None))  # a job, as the engine's
    sampler.add(task(busy, [4, 8, 9], max_tokens=40, temperature=1.0, seed=1, stop=[]))
    worker = SimpleNamespace(samplers={"base": sampler}, drop_idle_live_samplers=lambda: None,
                             refresh_live_copies=lambda: None)
    ops = WorkerOperations(worker)
    arrived = SimpleNamespace(kind="sample", owner="key-b", args=SimpleNamespace(snapshot_key=None))
    launch = sampler._launch_burst

    def launch_and_meanwhile_submit(pending: int):
        if sampler.stats["decode_reads"] == 1:
            ops.sample_submit(arrived)  # the event loop stores and submits a request mid-slice
        return launch(pending)

    sampler._launch_burst = launch_and_meanwhile_submit
    with torch.inference_mode():
        assert ops.sample_step(60.0) == []  # a minute of budget: only the arrival ends it
    assert sampler.stats["decode_reads"] == 2 and sampler.stats["slices_ended_for_arrivals"] == 1
    assert list(ops._sample_inbox) == [arrived] and sampler.rows  # taken in by the next slice
