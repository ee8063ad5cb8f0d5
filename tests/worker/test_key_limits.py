"""What one owner (API key) may hold in the worker: training runs and sampler snapshots.

A new snapshot never evicts one that another owner is using; it makes room from its own
owner's snapshots first, and is refused (changing nothing) when no room can be made.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tinsmith.checkpoints.peft_format import save_peft_adapter
from tinsmith.errors import CapacityError
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.service import RuntimeOptions, Worker

SPEC = LoraSpec(rank=2, seed=0)


@pytest.fixture
def make_worker(qwen3_dir):
    def make(**options) -> Worker:
        w = Worker(RuntimeOptions(**options))
        w.add_base_model(str(qwen3_dir))
        return w

    return make


def _run(w: Worker, model_id: str, owner: str) -> str:
    w.create_model(model_id, next(iter(w.bases)), SPEC, owner=owner)
    return model_id


def _occupy(w: Worker, key: str) -> None:
    """Queue a sample request on snapshot ``key`` in its sampler (not yet stepped): in use."""
    snap = w.snapshots[key]
    inp = SampleInput(np.array([1, 2, 3], dtype=np.int64), 1, SamplingParams(max_tokens=4))
    w.sampler(snap.base).add(SampleTask(f"job-{key}", snap.slot, inp))


def _age(w: Worker, key: str, seconds: float) -> None:
    w.snapshots[key].last_used = time.monotonic() - seconds


def _slots(w: Worker) -> set[int]:
    """Adapter slots installed on the base model's layers (snapshots hold one each)."""
    model = next(iter(w.bases.values())).loaded.model
    return set(model.model.layers[0].self_attn.q_proj.adapters)


def test_another_keys_recently_used_snapshot_is_never_evicted(make_worker):
    w = make_worker(max_sampler_snapshots=2, sampler_snapshot_idle_s=60)
    a, b = _run(w, "a:train:0", "key-a"), _run(w, "b:train:0", "key-b")
    w.snapshot(a, "a-1", owner="key-a")
    for i in range(1, 5):  # the server is full after b-1: each new one of b's replaces b's own
        w.snapshot(b, f"b-{i}", owner="key-b")
        assert set(w.snapshots) == {"a-1", f"b-{i}"}
    # once a's snapshot is idle (unused past the window, nothing queued), it may make room
    _age(w, "a-1", 61)
    _age(w, "b-4", 30)
    w.snapshot(b, "b-5", owner="key-b")
    assert set(w.snapshots) == {"b-4", "b-5"}


def test_snapshots_in_use_are_kept_and_a_full_server_refuses_changing_nothing(make_worker):
    w = make_worker(max_sampler_snapshots=2, sampler_snapshot_idle_s=0)  # everything not in use is idle
    a, b = _run(w, "a:train:0", "key-a"), _run(w, "b:train:0", "key-b")
    w.snapshot(a, "a-1", owner="key-a")
    w.snapshot(b, "b-1", owner="key-b")
    _occupy(w, "a-1")  # running in the sampler
    before = (dict(w.snapshots), _slots(w))
    for owner, model in (("key-a", a), ("key-b", b)):
        with pytest.raises(CapacityError, match="--max-sampler-snapshots"):
            # b-1 is only queued (a request not yet handed to the sampler): in use as well
            w.snapshot(model, "new", owner=owner, queued={"b-1"})
    assert (dict(w.snapshots), _slots(w)) == before
    # with b-1's request gone, b-1 is idle again and makes room
    w.snapshot(a, "a-2", owner="key-a")
    assert set(w.snapshots) == {"a-1", "a-2"}


def test_eviction_order_own_idle_then_own_stored_then_others_idle_then_own_recent(make_worker, tmp_path):
    w = make_worker(max_sampler_snapshots=4, sampler_snapshot_idle_s=60)
    a, b = _run(w, "a:train:0", "key-a"), _run(w, "b:train:0", "key-b")
    spec, tensors, base = w.adapter_weights(a)
    stored = tmp_path / "a-stored"
    save_peft_adapter(stored, spec, tensors, base.name)  # what save_weights_for_sampler(name) writes
    w.snapshot(b, "b-other-idle", owner="key-b")
    w.snapshot(a, "a-recent", owner="key-a")
    w.snapshot(a, "a-stored", owner="key-a", reloadable=True)
    w.snapshot(a, "a-idle", owner="key-a")
    _age(w, "b-other-idle", 600)
    _age(w, "a-idle", 120)
    _age(w, "a-recent", 30)
    _age(w, "a-stored", 30)
    evicted = []
    for i in range(4):
        held = set(w.snapshots)
        w.snapshot(a, f"a-new-{i}", owner="key-a")
        (gone,) = held - set(w.snapshots)
        evicted.append(gone)
        _age(w, f"a-new-{i}", 1)  # each new one is the most recently used of a's
    assert evicted == ["a-idle", "a-stored", "b-other-idle", "a-recent"]
    # a stored snapshot evicted is only out of memory: it loads again from disk
    w.load_snapshot("a-stored", base.name, stored, owner="key-a")
    assert "a-stored" in w.snapshots and w.snapshots["a-stored"].reloadable
    assert "a-new-0" not in w.snapshots  # its room came from a's own least recently used


def test_per_key_snapshot_cap_makes_room_from_the_keys_own(make_worker):
    w = make_worker(max_sampler_snapshots=10, max_sampler_snapshots_per_key=2)
    a, b = _run(w, "a:train:0", "key-a"), _run(w, "b:train:0", "key-b")
    w.snapshot(b, "b-1", owner="key-b")
    w.snapshot(a, "a-1", owner="key-a")
    w.snapshot(a, "a-2", owner="key-a")
    w.use_snapshot("a-1")  # a-2 is now a's least recently used
    w.snapshot(a, "a-3", owner="key-a")
    assert set(w.snapshots) == {"b-1", "a-1", "a-3"}
    _occupy(w, "a-1")
    _occupy(w, "a-3")
    with pytest.raises(CapacityError, match="--max-sampler-snapshots-per-key 2"):
        w.snapshot(a, "a-4", owner="key-a")
    w.snapshot(b, "b-2", owner="key-b")  # the other key is not held back
    assert set(w.snapshots) == {"b-1", "b-2", "a-1", "a-3"}


def test_per_key_run_cap(make_worker):
    w = make_worker(max_runs_per_key=2)
    _run(w, "a:train:0", "key-a")
    _run(w, "a:train:1", "key-a")
    _run(w, "a:train:0", "key-a")  # a replayed create of a held run is not a new run
    with pytest.raises(CapacityError, match="--max-runs-per-key 2"):
        _run(w, "a:train:2", "key-a")
    assert "a:train:2" not in w.placements
    _run(w, "b:train:0", "key-b")
    w.unload_model("a:train:0")
    _run(w, "a:train:2", "key-a")
    assert sorted(w.placements) == ["a:train:1", "a:train:2", "b:train:0"]
