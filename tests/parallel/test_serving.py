"""The worker under ``tensor_parallel_size=2`` (rank 0 here, rank 1 a child process): sampling
slices cut short by a time budget that only rank 0 keeps, cancellations that only rank 0 sees,
Dimuon runs stepping as in one process, and what the tensor-parallel code does not cover refused
before any rank starts."""

from __future__ import annotations

import dataclasses

import time

import numpy as np
import pytest
import torch

from tinsmith.engine.device_faults import device_fault
from tinsmith.errors import InvalidInputError
from tinsmith.parallel.group import ParallelError
from tinsmith.parallel.serving import check_servable, rank_device
from tinsmith.models.loading import read_config
from tinsmith.sampling.cancel import CancelBoard, SampleCancelled
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import AdamParams, Datum, DimuonParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.service import RuntimeOptions, Worker

BUDGET_S = 0.002  # a sampling slice: a few decode steps of the tiny model, never all of them


def _worker(model_dir, tp: int, kv_layout: str = "auto") -> tuple[Worker, object]:
    # A chunk size below the scenario's prompts: their prefills run in chunks on every rank alike.
    w = Worker(RuntimeOptions(device="cpu", dtype="float32", tensor_parallel_size=tp, sampler_prefill_chunk_tokens=4,
                              sampler_kv_cache_layout=kv_layout))
    base = w.add_base_model("m", str(model_dir))
    return w, base


def _train_and_snapshot(w: Worker) -> int:
    g = np.random.default_rng(0)
    toks = g.integers(0, 512, 20)
    w.create_model("run", "m", LoraSpec(rank=4, seed=3))
    datum = Datum(tokens=toks[:-1], loss_inputs={"target_tokens": toks[1:], "weights": np.ones(19, np.float32)})
    fb = w.fb_begin("run", [ForwardBackwardInput([datum], "cross_entropy")])
    while not fb.done:
        w.fb_advance([(fb, 8)], 8)  # a few tokens a chunk: the datum runs over several calls
    w.optim_step("run", AdamParams(learning_rate=1e-2))
    return w.snapshot("run", "snap").slot


def _forward_backward(w: Worker, run: str) -> np.ndarray:
    """The target logprobs of a fixed datum under ``run``'s current weights (gradients accumulate)."""
    toks = np.random.default_rng(2).integers(0, 512, 16)
    datum = Datum(tokens=toks[:-1], loss_inputs={"target_tokens": toks[1:], "weights": np.ones(15, np.float32)})
    fb = w.fb_begin(run, [ForwardBackwardInput([datum], "cross_entropy")])
    w.fb_advance([(fb, 1 << 20)], 1 << 20)
    return fb.results[0].outputs[0]["logprobs"]


def _tasks(slot: int) -> list[SampleTask]:
    g = np.random.default_rng(1)

    def task(key: str, slot: int | None, prompt: int, n: int, owner: str, **params) -> SampleTask:
        return SampleTask(key, slot, SampleInput(g.integers(0, 512, prompt), n, SamplingParams(stop=[], **params)),
                          owner)

    # Two owners: the sampler admits "base" second (fair turns between owners), on every rank alike.
    return [task("greedy", slot, 5, 1, "a", max_tokens=24, temperature=0.0),
            task("seeded", slot, 7, 2, "a", max_tokens=24, temperature=1.0, seed=4),
            task("base", None, 3, 1, "b", max_tokens=24, temperature=0.7, seed=9),
            task("cancelled", slot, 4, 1, "a", max_tokens=400, temperature=1.0, seed=5)]


def _sample(w: Worker, base, slot: int) -> tuple[dict, int]:
    sampler = w.sampler(base)
    board = CancelBoard(key_id=lambda key: key)
    sampler.cancellations = board
    local = getattr(sampler, "_local", sampler)  # rank 0's own sampler under tensor parallelism
    validate, w.admitted = local._validate, []
    local._validate = lambda t: (w.admitted.append(t.key), validate(t))[1]
    for t in _tasks(slot):
        sampler.add(t)
    done, slices = {}, 0
    while sampler.has_work():
        for key, res in sampler.step(BUDGET_S):
            done[key] = res
        slices += 1
        if slices == 2:
            board.post("cancelled")
    return done, slices


def test_time_budgeted_slices_and_cancellations_stay_in_step(qwen3_dir):
    w1, b1 = _worker(qwen3_dir, 1)
    ref, _ = _sample(w1, b1, _train_and_snapshot(w1))
    w2, b2 = _worker(qwen3_dir, 2)
    try:
        got, slices = _sample(w2, b2, _train_and_snapshot(w2))
        assert slices > 3  # the budget cut decoding into slices (rank 1 ran each as rank 0 did)
        assert w2.tp_group.healthy
        assert w2.sampler(b2)._local.agreements > slices
        assert w2.sampler(b2)._local.prefill_chunk_tokens == 4  # the options reach every rank's sampler
        assert w2.sampler(b2)._local.stats["prefill_chunks"] > 0
        assert isinstance(got["cancelled"], SampleCancelled) and isinstance(ref["cancelled"], SampleCancelled)
        # The owners reached the ranks' samplers: "base" (the second owner's) was admitted second.
        # ("cancelled" may be cancelled before its turn comes.)
        assert w1.admitted[:3] == w2.admitted[:3] == ["greedy", "base", "seeded"], (w1.admitted, w2.admitted)
        for key in ("greedy", "seeded", "base"):
            for a, b in zip(ref[key].sequences, got[key].sequences):
                np.testing.assert_array_equal(a.tokens, b.tokens)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        # a request without a seed: rank 0 draws one for every rank, so the ranks cannot diverge
        sampler = w2.sampler(b2)
        sampler.add(SampleTask("unseeded", None, SampleInput(np.arange(4), 2, SamplingParams(max_tokens=6, stop=[]))))
        while sampler.has_work():
            for key, res in sampler.step(BUDGET_S):
                assert key == "unseeded" and not isinstance(res, Exception), res
        assert w2.tp_group.healthy

        # Dimuon steps through the group as in one process (its split factors' momenta gathered).
        for w in (w1, w2):
            w.create_model("dimuon", "m", LoraSpec(rank=2, seed=1), optimizer_type="dimuon")
            _forward_backward(w, "dimuon")
            w.optim_step("dimuon", DimuonParams(learning_rate=5e-2))
        np.testing.assert_allclose(_forward_backward(w2, "dimuon"), _forward_backward(w1, "dimuon"), atol=1e-5, rtol=0)
        w2.unload_model("dimuon")
        assert set(w2.placements) == {"run"}

        # An adapter without a seed: rank 0 draws it, so every rank slices the same adapter and
        # its exported state computes, in one process, what the two ranks computed.
        w2.create_model("unseeded", "m", LoraSpec(rank=4))
        fb_rounds = [_forward_backward(w2, "unseeded") for _ in range(2)]
        w2.optim_step("unseeded", AdamParams(learning_rate=1e-2))
        after = _forward_backward(w2, "unseeded")
        w1.load_training_state("copy", "m", w2.export_training_state("unseeded"), create=True)
        np.testing.assert_allclose(_forward_backward(w1, "copy"), after, atol=1e-5, rtol=0)
        np.testing.assert_allclose(fb_rounds[0], fb_rounds[1], atol=1e-6)

        w2.tp_group.procs[0].kill()
        w2.tp_group.procs[0].join()
        with pytest.raises(ParallelError, match="rank 1 of 2 .* exited") as exc:
            w2.optim_step("run", AdamParams(learning_rate=1e-2))
        assert device_fault(exc.value) is not None  # the engine stops and /healthz turns unhealthy
    finally:
        w2.close()


def test_sharded_samplers_page_their_heads_as_one_process_keeps_rows(qwen3_dir):
    """Each rank's paged cache holds its own K/V heads; the ranks sample what one process does."""
    w1, b1 = _worker(qwen3_dir, 1)
    ref, _ = _sample(w1, b1, _train_and_snapshot(w1))
    w2, b2 = _worker(qwen3_dir, 2, kv_layout="paged")
    try:
        got, _ = _sample(w2, b2, _train_and_snapshot(w2))
        assert w2.sampler(b2)._local.paged_kv and not w1.sampler(b1).paged_kv
        for key in ("greedy", "seeded", "base"):
            for a, b in zip(ref[key].sequences, got[key].sequences):
                np.testing.assert_array_equal(a.tokens, b.tokens)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    finally:
        w2.close()


@pytest.mark.parametrize("fixture", ["qwen3_moe_dir", "qwen3_5_dir", "qwen3_vl_dir"])
def test_a_size_that_does_not_divide_is_refused_before_any_rank_starts(request, fixture):
    cfg = read_config(request.getfixturevalue(fixture))
    with pytest.raises(InvalidInputError, match=r"attention heads \(4\) do not divide by 3.*--tensor-parallel-size 1"):
        check_servable(cfg, 3, fixture)
    w = Worker(RuntimeOptions(device="cpu", tensor_parallel_size=3))
    with pytest.raises(InvalidInputError, match="cannot be served with --tensor-parallel-size 3"):
        w.add_base_model("m", str(request.getfixturevalue(fixture)))
    assert w.tp_group is None  # refused before any rank started


def test_key_value_heads_are_split_or_shared_and_other_sizes_refused(qwen3_dir):
    cfg = read_config(qwen3_dir)  # 4 query heads over 2 key/value heads
    check_servable(cfg, 2, "tiny")  # one key/value head per rank
    check_servable(cfg, 4, "tiny")  # each key/value head kept by two ranks
    wide = dataclasses.replace(cfg, num_heads=12, num_kv_heads=4, vocab_size=cfg.vocab_size * 3, intermediate_size=384)
    with pytest.raises(InvalidInputError, match=r"key/value heads \(4\) neither divide by 6 nor divide it"):
        check_servable(wide, 6, "wide")


def test_each_rank_gets_its_own_gpu():
    assert [rank_device("cuda", r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_device("cuda:2", 1) == torch.device("cuda", 3)
    assert rank_device("cpu", 1) == torch.device("cpu")
    with pytest.raises(InvalidInputError, match="CUDA GPUs or on the CPU"):
        rank_device("mps", 0)


def test_an_idle_group_outlives_its_collective_timeout():
    """Followers wait for the next call outside the collectives (whose timeout would end them)."""
    from tinsmith.parallel.serving import start_group

    group = start_group(2, "cpu", timeout_s=1.0)
    try:
        time.sleep(2.5)
        assert group.healthy, group.failure
        with pytest.raises(KeyError):  # refused alike on both ranks: the group stays usable
            group.call("configure", "no-such-model", 1, None)
        assert group.healthy and group.executor.calls == 1
    finally:
        group.close()


def test_a_rank_dying_inside_a_decode_step_fails_the_slice_naming_it(qwen3_dir):
    """The follower is killed as rank 0 starts a decode step (its collectives then meet a dead
    rank): the sampler does not swallow that as one step's error; the slice raises it, naming
    the rank that died."""
    w, base = _worker(qwen3_dir, 2)
    try:
        sampler = w.sampler(base)
        local = sampler._local
        decode, steps = local._decode_step, []

        def kill_on_third(done):
            steps.append(1)
            if len(steps) == 3:
                w.tp_group.procs[0].kill()
            return decode(done)

        local._decode_step = kill_on_third
        sampler.add(SampleTask("long", None, SampleInput(np.arange(4), 2, SamplingParams(
            max_tokens=50, temperature=0.0, stop=[]))))
        with pytest.raises(ParallelError, match="rank 1 of 2 .* exited") as exc:
            while sampler.has_work():
                sampler.step(60.0)
        assert len(steps) == 3
        assert "failed on rank 0 of 2" in str(exc.value)  # the collective that met the dead rank
        assert sampler.abort() == ["long"]  # the engine fails the request with the reason
        assert not w.tp_group.healthy and device_fault(exc.value) is not None
    finally:
        w.close()


def test_base_models_share_one_group(model_dirs, qwen3_moe_dir, qwen3_5_moe_dir):
    """Every base model is sharded over the same ranks (one process group per server); a
    mixture-of-experts model trains and samples with its experts split over the ranks, and a
    hybrid one (Gated DeltaNet, gated attention, a shared expert) with its heads split."""
    dirs = {"qwen3": model_dirs["qwen3"], "qwen3_moe": qwen3_moe_dir, "qwen3_5_moe": qwen3_5_moe_dir}

    def run(tp: int) -> dict:
        w = Worker(RuntimeOptions(device="cpu", dtype="float32", tensor_parallel_size=tp))
        try:
            out = {}
            for family, model_dir in dirs.items():
                base = w.add_base_model(family, str(model_dir))
                w.create_model(f"{family}-run", family, LoraSpec(rank=2, seed=1))
                w.optim_step(f"{family}-run", AdamParams(learning_rate=1e-2))
                out[family] = _forward_backward(w, f"{family}-run")
                sampler = w.sampler(base)
                sampler.add(SampleTask(family, None, SampleInput(np.arange(5), 1, SamplingParams(
                    max_tokens=6, temperature=0.0, stop=[]))))
                while sampler.has_work():
                    for key, res in sampler.step(BUDGET_S):
                        out[key + ":tokens"] = res.sequences[0].tokens
            if tp > 1:
                assert len(w.tp_group.procs) == tp - 1 and w.tp_group.healthy
            return out
        finally:
            w.close()

    one, two = run(1), run(2)
    for key in one:
        np.testing.assert_allclose(one[key], two[key], atol=1e-5, rtol=0)
