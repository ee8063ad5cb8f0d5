"""The worker under ``data_parallel_size=2`` (rank 0 here, rank 1 a child process, each holding a
whole replica) against one process: LoRA training with each chunk's datums split between the
replicas, the optimizer step over summed gradients, checkpoints, and sampling with each request
on one replica (placed by load and by shared prompt starts), cancellations included."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyrage
import pytest
import torch

from tinsmith.checkpoints.export import save_hf_model
from tinsmith.checkpoints.state_format import load_training_state, training_state_bytes
from tinsmith.engine.device_faults import device_fault
from tinsmith.errors import InvalidInputError
from tinsmith.parallel.comm import sum_grads
from tinsmith.parallel.group import ParallelError, TPGroup
from tinsmith.parallel.replicas import AFFINITY_SLACK_ROWS
from tinsmith.sampling.cancel import CancelBoard, SampleCancelled
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import AdamParams, Datum, DimuonParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.service import RuntimeOptions, Worker
from tinsmith.worker.warm_up import warm_up

BUDGET_S = 0.002  # a sampling slice: a few decode steps of the tiny model


def _worker(model_dir, dp: int, tp: int = 1) -> tuple[Worker, object]:
    w = Worker(RuntimeOptions(device="cpu", dtype="float32", data_parallel_size=dp, tensor_parallel_size=tp,
                              micro_batch_tokens=64))
    return w, w.add_base_model("m", str(model_dir))


def _datum(g, n: int) -> Datum:
    toks = g.integers(0, 512, n + 1)
    return Datum(tokens=toks[:-1], loss_inputs={"target_tokens": toks[1:],
                                               "weights": g.random(n).astype(np.float32)})


def _requests() -> list[ForwardBackwardInput]:
    """Uneven datums (so the replicas' shares differ), a one-datum request (one replica runs
    nothing of it) and a forward-only one."""
    g = np.random.default_rng(0)
    return [ForwardBackwardInput([_datum(g, n) for n in (30, 7, 19, 12, 25)], "cross_entropy"),
            ForwardBackwardInput([_datum(g, 9)], "cross_entropy"),
            ForwardBackwardInput([_datum(g, 14), _datum(g, 5)], "cross_entropy", forward_only=True)]


def _train(w: Worker, run: str, chunk: int, hp=None) -> list:
    """Two rounds of forward/backward (``chunk`` tokens a call) and a step after each (AdamW,
    or ``hp``); the results of every request."""
    hp = hp or AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    out = []
    for _ in range(2):
        passes = [w.fb_begin(run, [req]) for req in _requests()]
        while not all(p.done for p in passes):
            w.fb_advance([(p, chunk) for p in passes if not p.done], chunk)
        out += [p.results[0] for p in passes]
        out.append(w.optim_step(run, hp))
    return out


def _assert_same_training(ref: list, got: list) -> None:
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        if isinstance(a, dict):  # optimizer step metrics (the gradient norm over summed gradients)
            assert a.keys() == b.keys()
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-5), k
            continue
        assert not isinstance(b, Exception), b
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)
        for k in a.metrics:
            assert b.metrics[k] == pytest.approx(a.metrics[k], abs=1e-4), k


@dataclasses.dataclass
class _Job:
    """A task key as the engine's: an unhashable object (its jobs are dataclasses)."""

    name: object


def _sample_all(sampler, tasks: list[SampleTask], cancel: str | None = None) -> dict:
    """Run ``tasks`` (keyed by the engine's kind of key) to the end; results by the tasks' keys."""
    board = CancelBoard(key_id=lambda job: job.name)
    sampler.cancellations = board
    for t in tasks:
        sampler.add(dataclasses.replace(t, key=_Job(t.key)))
    done, slices = {}, 0
    while sampler.has_work():
        for job, res in sampler.step(BUDGET_S):
            done[job.name] = res
        slices += 1
        if slices == 2 and cancel is not None:
            board.post(cancel)
    return done


def _tasks(slot: int | None) -> list[SampleTask]:
    g = np.random.default_rng(1)

    def task(key: str, slot: int | None, prompt: int, n: int, **params) -> SampleTask:
        return SampleTask(key, slot, SampleInput(g.integers(0, 512, prompt), n, SamplingParams(stop=[], **params)))

    return [task("greedy", slot, 5, 1, max_tokens=20, temperature=0.0),
            task("seeded", slot, 7, 3, max_tokens=20, temperature=1.0, seed=4),
            task("base", None, 3, 2, max_tokens=20, temperature=0.7, seed=9),
            task("long-greedy", None, 9, 1, max_tokens=30, temperature=0.0),
            task("cancelled", slot, 4, 1, max_tokens=400, temperature=1.0, seed=5)]


def test_replicas_train_and_sample_as_one_process(qwen3_dir):
    w1, b1 = _worker(qwen3_dir, 1)
    w2, b2 = _worker(qwen3_dir, 2)
    try:
        assert w2.chunk_tokens() == 2 * w1.chunk_tokens()  # a chunk per replica
        for w in (w1, w2):
            w.create_model("run", "m", LoraSpec(rank=4, seed=3))
        ref = _train(w1, "run", 1 << 20)
        got = _train(w2, "run", 40)  # small chunks: requests run over several calls, shares differ per call
        _assert_same_training(ref, got)
        s1, s2 = w1.export_training_state("run"), w2.export_training_state("run")
        # Adam divides by the root of the second moment: where a gradient is near zero, the two
        # replicas' summation order (an all-reduce against one process's sum) moves a step by up
        # to ~1e-4 of the weight (seen: 1.6e-6 on one of 512 entries, on a CPU whose kernels sum
        # in another order than the machine this test was written on).
        for k in s1.weights:
            np.testing.assert_allclose(s1.weights[k].numpy(), s2.weights[k].numpy(), atol=1e-6, rtol=2e-4)
        for k in s1.optimizer:
            np.testing.assert_allclose(s1.optimizer[k].numpy(), s2.optimizer[k].numpy(), atol=1e-6, rtol=0)

        # sampling from a snapshot, the base model and the inflight weights: each request on one replica
        slots = [w.snapshot("run", "snap").slot for w in (w1, w2)]
        ref = _sample_all(w1.sampler(b1), _tasks(slots[0]), cancel="cancelled")
        sampler = w2.sampler(b2)
        got = _sample_all(sampler, _tasks(slots[1]), cancel="cancelled")
        assert isinstance(ref["cancelled"], SampleCancelled) and isinstance(got["cancelled"], SampleCancelled)
        for key in ("greedy", "seeded", "base", "long-greedy"):
            assert len(ref[key].sequences) == len(got[key].sequences)
            for a, b in zip(ref[key].sequences, got[key].sequences):
                np.testing.assert_array_equal(a.tokens, b.tokens)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert sampler._local.stats["decode_steps"] > 0 and sampler._stats[0]["decode_steps"] > 0  # both decoded
        assert sampler.stats["decode_steps"] == sampler._local.stats["decode_steps"] + sampler._stats[0]["decode_steps"]
        assert not sampler.has_work() and sampler._load == [0, 0]
        assert w2.tp_group.healthy
    finally:
        w2.close()


def test_replicas_of_sharded_models_train_and_sample_as_one_process(qwen3_dir):
    """Two replicas, each sharded over two ranks (four processes): the chunk's datums split over
    the replicas, every shard of a replica running its share; each request sampled by one replica
    whose shards decode in lockstep."""
    w1, b1 = _worker(qwen3_dir, 1)
    w4, b4 = _worker(qwen3_dir, 2, tp=2)
    try:
        sampler = w4.sampler(b4)
        assert w4.tp_group.world_size == 4 and sampler._size == 2
        for w in (w1, w4):
            w.create_model("run", "m", LoraSpec(rank=4, seed=3))
        _assert_same_training(_train(w1, "run", 1 << 20), _train(w4, "run", 40))
        s1, s4 = w1.export_training_state("run"), w4.export_training_state("run")
        for k in s1.weights:  # gathered from the shards of rank 0's replica; rtol: Adam, as above
            np.testing.assert_allclose(s1.weights[k].numpy(), s4.weights[k].numpy(), atol=1e-6, rtol=2e-4)
        slots = [w.snapshot("run", "snap").slot for w in (w1, w4)]
        ref = _sample_all(w1.sampler(b1), _tasks(slots[0]), cancel="cancelled")
        got = _sample_all(sampler, _tasks(slots[1]), cancel="cancelled")
        assert isinstance(got["cancelled"], SampleCancelled)
        for key in ("greedy", "seeded", "base", "long-greedy"):
            for a, b in zip(ref[key].sequences, got[key].sequences):
                np.testing.assert_array_equal(a.tokens, b.tokens)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert sampler._local.stats["decode_steps"] > 0 and sampler._stats[0]["decode_steps"] > 0  # both decoded
        assert w4.tp_group.healthy
    finally:
        w4.close()


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2", "tp2"])
def test_runs_stepping_together_in_a_group_step_as_one_process_steps_them(qwen3_dir, dp, tp):
    """Two runs' optimizer steps in one call (as the engine hands over steps that are ready
    together): replicas sum both runs' gradients in one all-reduce, tensor-parallel ranks take
    the call once; the results are those of one process stepping each run alone (a Dimuon run
    among them), and a refused
    step (other hyperparameters than the run's optimizer takes) is refused alike on every rank.
    A full fine-tune stepping in the same call (its own runtime, sharded over the group: it
    steps by itself) matches one process's too."""

    w1, _ = _worker(qwen3_dir, 1)
    wg, _ = _worker(qwen3_dir, dp, tp=tp)
    hps = {"a": AdamParams(learning_rate=1e-2, grad_clip_norm=1.0), "b": AdamParams(learning_rate=5e-3, beta1=0.8),
           "d": DimuonParams(learning_rate=1e-2, grad_clip_norm=1.0), "full": AdamParams(learning_rate=1e-3)}
    try:
        for w in (w1, wg):
            w.create_model("a", "m", LoraSpec(rank=4, seed=3))
            w.create_model("b", "m", LoraSpec(rank=2, seed=4, train_unembed=False))
            w.create_model("d", "m", LoraSpec(rank=2, seed=6), optimizer_type="dimuon")  # steps alone, gathering under TP
            w.create_model("full", "m", None)
            w.create_model("c", "m", LoraSpec(rank=2, seed=5))  # steps with the wrong hyperparameters
        for _ in range(2):
            results = {}
            for w in (w1, wg):
                passes = {run: w.fb_begin(run, _requests()[:2]) for run in hps}
                while not all(p.done for p in passes.values()):
                    w.fb_advance([(p, 40) for p in passes.values() if not p.done], 80)
                results[w] = [r for p in passes.values() for r in p.results]
            _assert_same_training(results[w1], results[wg])
            ref = [w1.optim_step(run, hp) for run, hp in hps.items()]
            got = wg.optim_steps(list(hps.items()) + [("c", DimuonParams(learning_rate=1e-2))])
            _assert_same_training(ref, got[:4])
            assert isinstance(got[4], InvalidInputError), got[4]
        assert wg.tp_group.healthy
        for run in hps:
            s1, sg = w1.export_training_state(run), wg.export_training_state(run)
            assert s1.weights.keys() == sg.weights.keys()
            for k in s1.weights:  # rtol: Adam, as in test_replicas_train_and_sample_as_one_process
                np.testing.assert_allclose(s1.weights[k].numpy(), sg.weights[k].numpy(), atol=1e-6, rtol=2e-4)
    finally:
        wg.close()


def test_requests_sharing_a_prompt_go_to_one_replica_unless_it_is_much_busier(qwen3_dir):
    w1, b1 = _worker(qwen3_dir, 1)
    w, base = _worker(qwen3_dir, 2)
    try:
        sampler = w.sampler(base)
        prompts = {p: np.random.default_rng(p).integers(0, 512, 40) for p in range(4)}
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[])
        tasks = [SampleTask((p, i), None, SampleInput(prompts[p], 1, params)) for p in range(4) for i in range(4)]
        places = {}
        for t in tasks:  # as GRPO sends them: every prompt's requests in a row
            places[t.key] = sampler._place(t)
            sampler._load[places[t.key]] += 1
        for p in range(4):
            assert len({places[(p, i)] for i in range(4)}) == 1  # a prompt's requests share one prefix cache
        assert sorted(sampler._load) == [8, 8]  # and the prompts are spread over the replicas
        # a replica far busier than the other gets no more of its prompts
        first = places[(0, 0)]
        sampler._load[first] += AFFINITY_SLACK_ROWS + 8
        assert sampler._place(SampleTask("late", None, SampleInput(prompts[0], 1, params))) != first
        sampler._load = [0, 0]

        done = _sample_all(sampler, tasks)
        ref = _sample_all(w1.sampler(b1), tasks)
        assert sorted(done) == sorted(t.key for t in tasks)
        for key, res in ref.items():
            np.testing.assert_array_equal(res.sequences[0].tokens, done[key].sequences[0].tokens)
        # each prompt was prefilled once, on its replica, as in one process
        assert sampler.stats["prefill_tokens"] == w1.sampler(b1).stats["prefill_tokens"] == 4 * 40

        # A slice that fails on one replica fails on all at once (none waits out the collective
        # timeout for it), and the group goes on.
        local, real = sampler._local, sampler._local.step

        def broken(budget_s):
            local.step = real
            raise RuntimeError("decode failed")

        local.step = broken
        sampler.add(tasks[0])
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="decode failed"):
            sampler.step(BUDGET_S)
        assert time.monotonic() - started < 30 and w.tp_group.healthy
        sampler.abort()
        assert not sampler.has_work()
    finally:
        w.close()


def test_an_unseeded_adapter_is_the_same_on_every_replica_and_refusals_name_the_option(qwen3_dir):
    w1, _ = _worker(qwen3_dir, 1)
    w2, b2 = _worker(qwen3_dir, 2)
    try:
        assert warm_up(w2, b2) > 0  # every replica samples and trains once, and nothing is left behind
        sampler = w2.sampler(b2)
        # Top-p with prompt logprobs, plain temperature, greedy: one request per replica each; the
        # greedy round's prompt is the second's, kept whole (its tail and last logits): no forward pass.
        assert sampler._local.stats["prefills"] == sampler._stats[0]["prefills"] == 2
        assert not sampler.has_work() and not b2.lora.units

        w2.create_model("unseeded", "m", LoraSpec(rank=4))  # rank 0 draws the seed for both replicas
        _train(w2, "unseeded", 50)
        w1.load_training_state("copy", "m", w2.export_training_state("unseeded"), create=True)
        probe = [ForwardBackwardInput(_requests()[0].data, "cross_entropy", forward_only=True)]
        a = w1.fb_begin("copy", probe)
        w1.fb_advance([(a, 1 << 20)], 1 << 20)
        b = w2.fb_begin("unseeded", probe)  # computed across the replicas from their own adapters
        while not b.done:
            w2.fb_advance([(b, 1 << 20)], 1 << 20)
        for x, y in zip(a.results[0].outputs, b.results[0].outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)

        w2.tp_group.procs[0].kill()
        w2.tp_group.procs[0].join()
        with pytest.raises(ParallelError, match="data-parallel rank 1 of 2 .* exited") as exc:
            w2.optim_step("unseeded", AdamParams(learning_rate=1e-2))
        assert device_fault(exc.value) is not None  # the engine stops and /healthz turns unhealthy
    finally:
        w2.close()


def _full_runs_train_alike(one, group) -> tuple:
    """Create the "full" run on ``one`` (a one-process worker) and ``group``, train both the same
    way (the group in small chunks): the same training results, weights and optimizer state.
    Both exported states."""
    for w in (one, group):
        w.create_model("full", "m", None)
    _assert_same_training(_train(one, "full", 1 << 20), _train(group, "full", 40))
    s1, s2 = one.export_training_state("full"), group.export_training_state("full")
    assert s1.weights.keys() == s2.weights.keys() and s1.optimizer.keys() == s2.optimizer.keys()
    for part1, part2 in ((s1.weights, s2.weights), (s1.optimizer, s2.optimizer)):
        for k in part1:
            np.testing.assert_allclose(part1[k].numpy(), part2[k].numpy(), atol=1e-5, rtol=0)
    return s1, s2


_GREEDY = SampleTask("g", None, SampleInput(np.arange(3, 9), 1, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                stop=[])))


def _snapshots_sample_alike(one, group) -> list:
    """A snapshot of the "full" run in one process and in the group (gathered to rank 0, which
    samples it itself): the same greedy tokens and logprobs. Both results."""
    outs = []
    for w, b in (one, group):
        snap = w.snapshot("full", "full-snap")
        assert w.make_resident(snap)
        outs.append(_sample_all(w.sampler(b, snap), [_GREEDY])["g"])
    np.testing.assert_array_equal(outs[0].sequences[0].tokens, outs[1].sequences[0].tokens)
    np.testing.assert_allclose(outs[0].sequences[0].logprobs, outs[1].sequences[0].logprobs, atol=1e-5)
    return outs


def _inflight_samples_follow_the_live_weights(one, group) -> None:
    """An inflight sampler of the "full" run in one process (its live model) and in the group
    (rank 0's whole copy of the weights, gathered from the shards): the same greedy tokens and
    logprobs before and after a step; the group gathers again only when a step changed the
    weights, and rows decoding when a step lands read the new weights from the next slice."""
    (w1, _), (w2, _) = one, group
    hp = AdamParams(learning_rate=5e-2)

    def sample(w) -> object:
        sampler, slot = w.live_sampler("live")
        assert slot is None
        return _sample_all(sampler, [_GREEDY])["g"].sequences[0]

    def step(w) -> None:
        p = w.fb_begin("full", [_requests()[0]])
        while not p.done:
            w.fb_advance([(p, 1 << 20)], 1 << 20)
        w.optim_step("full", hp)

    def alike(a, b) -> None:
        # fp32 rounding of a sharded step against one process's, relative: up to 6e-6 of a logprob
        # seen after the step on one CPU (other CPUs' kernels round alike within 1e-5 absolute).
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=2e-5)

    for w in (w1, w2):
        w.publish_inflight("full", "live")
    before = [sample(w1), sample(w2)]
    alike(*before)
    assert w2.stats["live_weight_gathers"] == 1
    alike(sample(w2), before[1])  # the weights did not change: nothing gathered again
    assert w2.stats["live_weight_gathers"] == 1
    for w in (w1, w2):
        step(w)
    after = [sample(w1), sample(w2)]
    alike(*after)
    assert not np.allclose(after[1].logprobs, before[1].logprobs, atol=1e-4)  # the step's weights
    assert w2.stats["live_weight_gathers"] == 2

    # A row still decoding when a step lands: the copy is refreshed before the next slice.
    sampler, _ = w2.live_sampler("live")
    sampler.cancellations = CancelBoard(key_id=lambda job: job.name)
    sampler.add(dataclasses.replace(_GREEDY, key=_Job("pending")))
    assert not sampler.step(0.0) and sampler.rows  # admitted, decoding
    step(w2)
    w2.refresh_live_copies()
    assert w2.stats["live_weight_gathers"] == 3
    live = dict(w2.live_copies["full"].model.named_parameters())
    weights, _ = w2.full_weights("full")
    assert live.keys() <= weights.keys() and all(torch.equal(live[n], weights[n]) for n in live)
    assert "pending" in _sample_all(sampler, [])
    w2.refresh_live_copies()  # nothing decoding, nothing changed: no gather
    assert w2.stats["live_weight_gathers"] == 3


def test_a_full_fine_tune_is_sharded_over_the_replicas_and_matches_one_process(qwen3_dir, tmp_path):
    w1, b1 = _worker(qwen3_dir, 1)
    w2, b2 = _worker(qwen3_dir, 2)
    try:
        s1, s2 = _full_runs_train_alike(w1, w2)
        runtime = w2.placements["full"].runtime
        held = runtime._base.local.runtime.held_elements()  # rank 0's share of the run
        assert held["weights"] < 0.6 * held["model"] and held["optimizer"] < 1.2 * held["model"]

        # Checkpoints are written by both replicas, each its part, into one checkpoint.
        assert w2.writes_sharded("full") and not w1.writes_sharded("full")
        assert w2.sharded_state_bytes("full") == training_state_bytes(s2)
        size = w2.save_training_state_sharded("full", tmp_path / "state", "state")
        assert size == sum(f.stat().st_size for f in (tmp_path / "state").iterdir())
        saved = load_training_state(tmp_path / "state", with_optimizer=True)
        assert saved.steps == s2.steps
        for ref_part, got_part in ((s2.weights, saved.weights), (s2.optimizer, saved.optimizer)):
            assert ref_part.keys() == got_part.keys() and all(torch.equal(ref_part[k], got_part[k]) for k in ref_part)
        assert w2.sharded_weights_bytes("full") == sum(t.numel() * t.element_size() for t in s2.weights.values())
        w2.save_full_weights_sharded("full", tmp_path / "hf", (), "hf")
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

        # A snapshot gathers the whole weights to rank 0, which samples it itself.
        outs = _snapshots_sample_alike((w1, b1), (w2, b2))
        # The sharded Hugging Face export reloads as stored sampler weights and samples alike.
        stored = w2.load_snapshot("stored", "m", tmp_path / "hf")
        assert w2.make_resident(stored)
        again = _sample_all(w2.sampler(b2, stored), [_GREEDY])["g"]
        np.testing.assert_array_equal(again.sequences[0].tokens, outs[1].sequences[0].tokens)
        np.testing.assert_array_equal(again.sequences[0].logprobs, outs[1].sequences[0].logprobs)
        _inflight_samples_follow_the_live_weights((w1, b1), (w2, b2))
        w1.load_training_state("full", "m", s1, create=False)  # as trained above, for the comparison below

        # Unloaded, every replica frees its shard (and rank 0 its inflight copy); one process's
        # checkpoint loads into the replicas.
        w2.unload_model("full")
        assert w2.tp_group.call("_holder", "m").full == {} and not w2.live_copies
        # A Dimuon full fine-tune: each whole matrix's direction computed by one replica.
        w3, _ = _worker(qwen3_dir, 1)  # one process holds one full fine-tune at a time
        for w in (w3, w2):
            w.create_model("dimuon", "m", None, optimizer_type="dimuon")
        dimuon = DimuonParams(learning_rate=1e-2, grad_clip_norm=1.0)
        _assert_same_training(_train(w3, "dimuon", 1 << 20, dimuon), _train(w2, "dimuon", 40, dimuon))
        d1, d2 = w3.export_training_state("dimuon"), w2.export_training_state("dimuon")
        for k in d1.weights:
            np.testing.assert_allclose(d1.weights[k].numpy(), d2.weights[k].numpy(), atol=1e-5, rtol=0)
        w2.unload_model("dimuon")
        w2.load_training_state("again", "m", s1, create=True)
        probe = [ForwardBackwardInput(_requests()[0].data, "cross_entropy", forward_only=True)]
        a, b = w1.fb_begin("full", probe), w2.fb_begin("again", probe)
        w1.fb_advance([(a, 1 << 20)], 1 << 20)
        while not b.done:
            w2.fb_advance([(b, 30)], 30)
        for x, y in zip(a.results[0].outputs, b.results[0].outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)
        assert w2.tp_group.healthy
    finally:
        w2.close()


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_a_full_fine_tune_under_tensor_parallelism_is_sharded_over_every_rank(qwen3_dir, tmp_path, dp, tp):
    """The base model's ranks hold tensor-parallel shards; a full fine-tune is FSDP over all of
    them, each rank loading the whole checkpoint for it: training, its state and a snapshot
    sampled by rank 0 (a whole model built from the gathered weights) equal one process's."""
    w1, b1 = _worker(qwen3_dir, 1)
    wn, bn = _worker(qwen3_dir, dp, tp=tp)
    try:
        s1, sn = _full_runs_train_alike(w1, wn)
        held = wn.placements["full"].runtime._base.local.runtime.held_elements()  # rank 0's share
        assert held["weights"] < (1.2 / (dp * tp)) * held["model"]
        # Every rank writes its part of the checkpoint; read back, it is the state gathered above.
        assert wn.writes_sharded("full")
        wn.save_training_state_sharded("full", tmp_path / "state", "tinker://full/state")
        written = load_training_state(tmp_path / "state", with_optimizer=True)
        assert len(list((tmp_path / "state").glob("weights-*.safetensors"))) == dp * tp
        for k in sn.weights:
            assert torch.equal(written.weights[k], sn.weights[k]), k

        outs = _snapshots_sample_alike((w1, b1), (wn, bn))
        whole = wn.snapshots["full-snap"].model
        assert getattr(whole, "tp", None) is None and whole.lm_head.weight.shape[0] == whole.config.vocab_size
        # Stored sampler weights (a Hugging Face directory) load back as a whole model too.
        weights, base = wn.full_weights("full")
        save_hf_model(tmp_path / "stored", weights, base.loaded.model_dir)
        stored = wn.load_snapshot("stored", "m", tmp_path / "stored")
        assert wn.make_resident(stored)
        again = _sample_all(wn.sampler(bn, stored), [_GREEDY])["g"]
        np.testing.assert_array_equal(again.sequences[0].tokens, outs[0].sequences[0].tokens)
        # Inflight samplers read a whole copy on rank 0 (built from the config: rank 0 holds a shard).
        _inflight_samples_follow_the_live_weights((w1, b1), (wn, bn))
        assert getattr(wn.live_copies["full"].model, "tp", None) is None

        wn.unload_model("full")
        assert wn.tp_group.call("_holder", "m").full == {}
        # LoRA runs of the sharded base model are untouched by it.
        wn.create_model("run", "m", LoraSpec(rank=4, seed=3))
        w1.create_model("run", "m", LoraSpec(rank=4, seed=3))
        _assert_same_training(_train(w1, "run", 1 << 20), _train(wn, "run", 40))
        assert wn.tp_group.healthy
    finally:
        wn.close()


@pytest.mark.parametrize("fixture,dp,tp", [("qwen3_moe_dir", 2, 1), ("qwen3_5_moe_dir", 2, 1), ("gpt_oss_dir", 2, 1),
                                           ("qwen3_moe_dir", 1, 2)],
                         ids=["qwen3_moe-dp2", "qwen3_5_moe-dp2", "gpt_oss-dp2", "qwen3_moe-tp2"])
def test_full_fine_tunes_of_other_families_are_sharded_as_one_process_trains_them(request, fixture, dp, tp):
    """Routed experts (stacked, sharded by expert), Gated DeltaNet layers, attention sinks and
    biased experts under FSDP (from a copy of each replica, or under tensor parallelism read
    again layer by layer): training and the saved state equal one process's."""
    model_dir = request.getfixturevalue(fixture)
    w1, _ = _worker(model_dir, 1)
    w2, _ = _worker(model_dir, dp, tp=tp)
    try:
        _full_runs_train_alike(w1, w2)
    finally:
        w2.close()


def test_summed_gradients_keep_none_where_no_replica_has_one():
    """In a group of one nothing moves; the two-rank sum itself runs in the tests above."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((3,), 2.0)
    sum_grads([p, q], TPGroup.single())
    assert q.grad is None and torch.equal(p.grad, torch.full((3,), 2.0))


def test_checkpoints_of_a_sharded_full_fine_tune_go_through_the_operations(qwen3_dir, tmp_path):
    """save_state and save_weights_external of a full fine-tune sharded over 2 replicas: the quota
    is checked from the tensors' shapes before anything is written; the checkpoints are written by
    both replicas and load as the state the run holds."""
    from tinsmith.engine.scheduler import Job
    from tinsmith.errors import CapacityError
    from tinsmith.server.limits import KeyLimits
    from tinsmith.server.operations import SaveArgs, WorkerOperations
    from tinsmith.store import Store

    w2, _ = _worker(qwen3_dir, 2)
    try:
        w2.create_model("full", "m", None)
        _train(w2, "full", 40)
        store = Store(Store.default_sqlite_url(tmp_path / "db"))
        store.migrate()
        held = w2.export_training_state("full")
        need = training_state_bytes(held)

        def save(kind: str, name: str, quota: int):
            ops = WorkerOperations(w2, store, KeyLimits(checkpoint_quota_bytes=quota))
            args = SaveArgs(kind, name, f"tinker://full/{kind}/{name}", tmp_path / kind / name, owner="k")
            return getattr(ops, "_save_weights" if kind == "weights" else "_save_weights_external")(
                Job("r", kind, "full", None, args))

        with pytest.raises(CapacityError, match="quota exceeded: tinker://full/weights/s needs"):
            save("weights", "s", need - 1)
        assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())
        save("weights", "s", need + (1 << 20))
        saved = load_training_state(tmp_path / "weights" / "s", with_optimizer=True)
        for ref_part, got_part in ((held.weights, saved.weights), (held.optimizer, saved.optimizer)):
            assert ref_part.keys() == got_part.keys() and all(torch.equal(ref_part[k], got_part[k]) for k in ref_part)
        assert store.get_checkpoint("full", "weights", "s").size_bytes == sum(
            f.stat().st_size for f in (tmp_path / "weights" / "s").iterdir())
        (tmp_path / "external_weights").write_text("a file where the checkpoint's directory should be")
        with pytest.raises(CapacityError, match="could not write tinker://full/external_weights/hf"):
            save("external_weights", "hf", 1 << 40)  # fails alike on every replica: the group stays usable
        (tmp_path / "external_weights").unlink()
        save("external_weights", "hf", 1 << 40)
        assert (tmp_path / "external_weights" / "hf" / "model.safetensors.index.json").is_file()
        # encrypted to a recipient: every file, both replicas' shards included, only as NAME.age
        identity = pyrage.x25519.Identity.generate()
        ops = WorkerOperations(w2, store, KeyLimits())
        ops._save_weights_external(Job("r", "external_weights", "full", None, SaveArgs(
            "external_weights", "enc", "tinker://full/external_weights/enc", tmp_path / "enc", owner="k",
            age_recipients=(str(identity.to_public()),))))
        names = sorted(f.name for f in (tmp_path / "enc").iterdir())
        plain = sorted(f.name for f in (tmp_path / "external_weights" / "hf").iterdir())
        assert names == sorted(f"{n}.age" for n in plain)
        shard = "model-00002-of-00002.safetensors"
        assert pyrage.decrypt((tmp_path / "enc" / f"{shard}.age").read_bytes(), [identity]) == (
            tmp_path / "external_weights" / "hf" / shard).read_bytes()
        assert w2.tp_group.healthy
        store.close()
    finally:
        w2.close()
