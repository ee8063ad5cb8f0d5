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
