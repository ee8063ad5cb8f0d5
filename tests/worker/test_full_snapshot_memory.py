"""Full fine-tunes' sampler snapshots in the worker: frozen in host memory, at most
``resident_full_sampler_snapshots`` on the device, and their host bytes capped per owner and
for the server (a refusal changes nothing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinsmith.errors import CapacityError
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import SampleInput, SamplingParams
from tinsmith.worker.runtime import FULL_UNIT
from tinsmith.worker.service import RuntimeOptions, Worker


@pytest.fixture
def make_worker(qwen3_dir):
    def make(**options) -> Worker:
        w = Worker(RuntimeOptions(max_full_finetunes=2, **options))
        w.add_base_model(str(qwen3_dir))
        return w

    return make


def _full_run(w: Worker, model_id: str, owner: str) -> str:
    w.create_model(model_id, next(iter(w.bases)), None, owner=owner)
    return model_id


def _live(w: Worker, model_id: str) -> torch.Tensor:
    """One of the run's live weights (the embedding table)."""
    return dict(w.placement(model_id).runtime.unit(FULL_UNIT).named_params)["model.embed_tokens.weight"]


def _train(w: Worker, model_id: str) -> None:
    """What an optimizer step does to a full fine-tune: write every weight in place."""
    with torch.no_grad():
        for _, p in w.placement(model_id).runtime.unit(FULL_UNIT).named_params:
            p.add_(0.01)


def _resident_embedding(w: Worker, key: str) -> torch.Tensor:
    snap = w.snapshots[key]
    assert w.make_resident(snap)
    return snap.model.model.embed_tokens.weight.detach().clone()


def _model_bytes(w: Worker) -> int:
    return sum(p.numel() * p.element_size() for p in next(iter(w.bases.values())).loaded.model.parameters())


def test_more_snapshots_than_device_places_each_keeps_the_weights_it_saved(make_worker):
    w = make_worker(max_full_sampler_snapshots=3, resident_full_sampler_snapshots=1)
    run = _full_run(w, "a:train:0", "key-a")
    saved = {}
    for key in ("s1", "s2", "s3"):
        w.snapshot(run, key, owner="key-a")
        saved[key] = _live(w, run).detach().clone()
        _train(w, run)
    assert not torch.equal(saved["s1"], saved["s2"])
    for key in ("s2", "s1", "s3", "s1"):
        assert torch.equal(_resident_embedding(w, key), saved[key])
        assert w.resident_snapshots() == [key]  # the one before went back to host memory
    assert all(s.host_bytes == _model_bytes(w) for s in w.snapshots.values())


def test_a_decoding_snapshot_keeps_its_device_place_and_others_wait(make_worker):
    w = make_worker(max_full_sampler_snapshots=2, resident_full_sampler_snapshots=1)
    run = _full_run(w, "a:train:0", "key-a")
    w.snapshot(run, "s1", owner="key-a")
    w.snapshot(run, "s2", owner="key-a")
    s1, s2 = w.snapshots["s1"], w.snapshots["s2"]
    assert w.make_resident(s1)
    inp = SampleInput(np.array([1, 2, 3], dtype=np.int64), 1, SamplingParams(max_tokens=4))
    w.sampler(s1.base, s1).add(SampleTask("job", None, inp))
    assert not w.make_resident(s2)  # s1 is decoding: s2's request waits
    while w.samplers[s1.sampler_key].has_work():
        w.samplers[s1.sampler_key].step(1.0)
    assert w.make_resident(s2) and w.resident_snapshots() == ["s2"]


def test_host_bytes_are_capped_per_key_and_for_the_server(make_worker):
    w = make_worker(max_full_sampler_snapshots=8, sampler_snapshot_idle_s=3600)
    size = _model_bytes(w)
    w.options.max_snapshot_host_bytes_per_key = 2 * size
    w.options.max_snapshot_host_bytes = 3 * size
    a, b = _full_run(w, "a:train:0", "key-a"), _full_run(w, "b:train:0", "key-b")
    w.snapshot(a, "a1", owner="key-a", queued={"a1"})
    w.snapshot(a, "a2", owner="key-a", queued={"a1", "a2"})
    before = dict(w.snapshots)
    with pytest.raises(CapacityError, match="--max-snapshot-host-bytes-per-key"):  # both in use
        w.snapshot(a, "a3", owner="key-a", queued={"a1", "a2"})
    assert w.snapshots == before
    w.snapshot(a, "a3", owner="key-a", queued={"a2"})  # a1 is not in use: it makes room
    assert set(w.snapshots) == {"a2", "a3"}
    w.snapshot(b, "b1", owner="key-b")
    # the server's bytes are full; a's recently used snapshots are not b's to evict
    with pytest.raises(CapacityError, match="--max-snapshot-host-bytes"):
        w.snapshot(b, "b2", owner="key-b", queued={"b1"})
    assert set(w.snapshots) == {"a2", "a3", "b1"}
    w.snapshot(b, "b2", owner="key-b")  # b's own snapshot b1, not in use, makes room
    assert set(w.snapshots) == {"a2", "a3", "b2"}
    w.options.max_snapshot_host_bytes = size - 1
    with pytest.raises(CapacityError, match="more than this server allows"):
        w.snapshot(b, "b3", owner="key-b")


def test_inflight_sessions_follow_the_live_weights_and_hold_nothing(make_worker):
    w = make_worker()
    run = _full_run(w, "a:train:0", "key-a")
    w.publish_inflight(run, "live-1")
    sampler, slot = w.live_sampler("live-1")
    assert slot is None and not w.snapshots
    assert sampler.model is w.placement(run).runtime.model
    w.unload_model(run)
    assert "live-1" not in w.inflight and not any(k.startswith("live:") for k in w.samplers)


def test_an_inflight_lora_sample_fails_clearly_when_its_adapter_is_parked(make_worker):
    from tinsmith.types import LoraSpec

    w = make_worker(max_lora_adapters=1)
    base = next(iter(w.bases))
    w.create_model("a:train:0", base, LoraSpec(rank=2, seed=0), owner="key-a")
    w.create_model("b:train:0", base, LoraSpec(rank=2, seed=1), owner="key-b")  # parks a's adapter
    w.publish_inflight("a:train:0", "live-a")
    sampler, slot = w.live_sampler("live-a")  # brings a's adapter back into the model
    assert slot == w.placement("a:train:0").runtime.unit(w.placement("a:train:0").unit).slot
    # no stop token: an unseeded draw of an end-of-sequence token would end it at its prefill
    inp = SampleInput(np.array([1, 2, 3], dtype=np.int64), 1, SamplingParams(max_tokens=8, stop=[], seed=0))
    sampler.add(SampleTask("job-a", slot, inp))
    assert sampler.step(0.0) == []  # admitted, decoding
    # b trains: its adapter needs the one place, so a's (in use) is parked, and a's sample fails
    # instead of going on with the base weights alone
    w.placement("b:train:0").runtime.ensure_resident({w.placement("b:train:0").unit})
    [(key, result)] = sampler.step(1.0)
    assert key == "job-a" and isinstance(result, CapacityError) and "--max-lora-adapters" in str(result)
    assert not sampler.has_work()


def test_idle_samplers_of_this_process_give_back_memory_and_group_samplers_are_left_alone(make_worker):
    """``release_idle_sampler_memory`` (what training, prefills and snapshot placement call when out
    of memory) reaches this process's samplers, and leaves a process group's proxy sampler alone
    (it has no memory of its own here; its ranks must keep their caches alike)."""
    w = make_worker()
    base = next(iter(w.bases.values()))
    sampler = w.sampler(base)
    sampler.keep_cache_when_idle = True
    prompt = np.random.default_rng(1).integers(4, 500, 300)
    sampler.add(SampleTask("k", None, SampleInput(prompt, 8, SamplingParams(max_tokens=200, stop=[], seed=1))))
    while sampler.has_work():
        sampler.step(1.0)

    class GroupProxy:  # as tinsmith.parallel's TPSampler / ReplicaSampler: no release_memory
        def has_work(self) -> bool:
            return False

    w.samplers["group"] = GroupProxy()  # type: ignore[assignment]
    kept = sampler.cache.nbytes()
    assert w.release_idle_sampler_memory() > 0 and sampler.cache.nbytes() < kept
    assert w.release_idle_sampler_memory() == 0  # nothing kept any more
