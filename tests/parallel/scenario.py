"""Scenarios run alike on one process and on each tensor-parallel rank, and their comparison.

They run in the rank processes (so they live in an importable module, not a test file) and in
the test process for the single-process reference; both return the same structure of results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinsmith.checkpoints.state_format import TrainingState, load_training_state, save_training_state
from tinsmith.models.loading import load_model
from tinsmith.parallel.decode import greedy_decode
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.runtime import TPTrainingRuntime
from tinsmith.parallel.shard import shard_causal_lm
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.types import AdamParams, Datum, DimuonParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

TOL = dict(rtol=1e-5, atol=1e-5)


def assert_same(ref, got, where: str = "") -> None:
    """Equal structure, equal integers and strings, floats within 1e-5 (relative, and absolute
    against the tensor's largest entry when that exceeds 1: summing the ranks' partial results
    in another order moves each entry by float noise of the tensor's scale, and Gated DeltaNet's
    gradients reach hundreds)."""
    if isinstance(ref, dict):
        assert sorted(ref) == sorted(got), where
        for k in ref:
            assert_same(ref[k], got[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ref) == len(got), where
        for i, (a, b) in enumerate(zip(ref, got)):
            assert_same(a, b, f"{where}[{i}]")
    elif ref is None:
        assert got is None, where
    elif isinstance(ref, str):
        assert ref == got, f"{where}: {ref!r} != {got!r}"
    elif isinstance(ref, torch.Tensor) and not ref.is_floating_point():
        assert torch.equal(ref, got), f"{where}: {ref} != {got}"
    else:
        ref, got = torch.as_tensor(ref), torch.as_tensor(got)
        scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
        torch.testing.assert_close(got, ref, rtol=TOL["rtol"], atol=TOL["atol"] * scale, msg=lambda m: f"{where}: {m}")


def build_runtime(model_dir: str, tp: TPGroup | None) -> TrainingRuntime:
    """A plain runtime on the whole model (``tp`` None), or this rank's sharded runtime. Logits
    go 5 rows at a time, so a batch spans several chunks."""
    model = load_model(model_dir, "cpu", torch.float32).model
    # Qwen2 also runs with gradient checkpointing: recomputed layers redo their collectives.
    kw = dict(logit_chunk_bytes=4 * model.config.vocab_size * 5, gradient_checkpointing=model.config.family == "qwen2")
    if tp is None:
        return TrainingRuntime(model, **kw)
    return TPTrainingRuntime(shard_causal_lm(model, tp), **kw)


def make_data(seed: int, lengths: list[int], vocab: int) -> list[Datum]:
    g = np.random.default_rng(seed)
    out = []
    for n in lengths:
        toks = g.integers(0, vocab, n).astype(np.int64)
        out.append(Datum(tokens=toks, loss_inputs={"target_tokens": np.roll(toks, -1),
                                                   "weights": g.uniform(0.2, 1.0, n).astype(np.float32)}))
    return out


def _random_like(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in sorted(state.items())}


def run_scenario(rt: TrainingRuntime, sharded: bool, save_to: str | None = None, load_from: str | None = None) -> dict:
    """Two adapters: seeded creation, a loaded nonzero state, one shared forward/backward, one
    clipped AdamW step each, logprobs after it, and greedy decoding with and without an adapter.

    ``save_to``: write adapter 0's state after the step there as a checkpoint (rank 0 writes).
    ``load_from``: load such a checkpoint into a fresh adapter; report its state and logprobs.
    """
    def export(u):
        return rt.export_full_state(u) if sharded else rt.unit(u).export_state()

    def load(u, w, o):
        rt.import_full_state(u, w, o) if sharded else rt.unit(u).import_state(w, o)

    def grads(u):
        return rt.full_grads(u) if sharded else {n: p.grad.clone() for n, p in rt.unit(u).named_stepped}

    vocab = rt.config.vocab_size
    units = [rt.create_adapter(LoraSpec(rank=4, seed=7)),
             rt.create_adapter(LoraSpec(rank=2, seed=8, train_unembed=False))]
    out: dict = {"init": export(units[0])[0]}
    for i, u in enumerate(units):
        load(u, _random_like(export(u)[0], seed=100 + i), None)
    data = [make_data(1, [9, 5], vocab), make_data(2, [7], vocab)]  # load_and_score reads data[0] again
    reqs = [TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in zip(units, data)]
    res = rt.forward_backward(reqs)
    for r in res:
        if isinstance(r, Exception):
            raise r
    out["logprobs"] = [o["logprobs"] for r in res for o in r.outputs]
    out["loss"] = [r.metrics["loss:sum"] for r in res]
    out["grads"] = [grads(u) for u in units]
    out["step"] = [rt.optim_step(u, AdamParams(learning_rate=1e-2, grad_clip_norm=0.05)) for u in units]
    out["after"] = [export(u) for u in units]
    again = rt.forward_backward([TrainRequest(units[0], ForwardBackwardInput(data[0], "cross_entropy", forward_only=True))])
    out["logprobs_after"] = [o["logprobs"] for o in again[0].outputs]
    spec0 = LoraSpec(rank=4, seed=7)
    if save_to is not None and (not sharded or rt.tp.rank == 0):
        w, o = out["after"][0]
        save_training_state(Path(save_to), TrainingState("tiny", spec0, w, o, steps=1))
    if load_from is not None:
        out.update(load_and_score(rt, sharded, load_from))
    prompts = torch.from_numpy(np.random.default_rng(3).integers(0, vocab, (2, 6)))
    out["greedy_base"] = greedy_decode(rt.model, prompts, 6)
    out["greedy_lora"] = greedy_decode(rt.model, prompts, 6, slot=rt.unit(units[0]).slot)
    return out


def load_and_score(rt: TrainingRuntime, sharded: bool, load_from: str) -> dict:
    """A fresh adapter loaded from the checkpoint at ``load_from``: its state and logprobs."""
    state = load_training_state(Path(load_from), with_optimizer=True)
    unit = rt.create_adapter(state.lora)
    if sharded:
        rt.import_full_state(unit, state.weights, state.optimizer)
    else:
        rt.unit(unit).import_state(state.weights, state.optimizer)
    data = make_data(1, [9, 5], rt.config.vocab_size)
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", forward_only=True))])
    return {"loaded_state": rt.export_full_state(unit) if sharded else rt.unit(unit).export_state(),
            "loaded_logprobs": [o["logprobs"] for o in res.outputs]}


def joint_steps_rank_main(tp: TPGroup, model_dir: str) -> dict:
    """Two equal sharded runtimes of three adapters train alike; one steps them one by one, the
    other together (``optim_steps``: two collectives for all). Per step and adapter: whether the
    results and the full-size states (weights, optimizer) are bit-identical."""
    specs = [LoraSpec(rank=4, seed=1), LoraSpec(rank=2, seed=2, train_unembed=False), LoraSpec(rank=4, seed=3)]
    hps = [AdamParams(learning_rate=1e-2, grad_clip_norm=0.05), AdamParams(learning_rate=2e-3, beta1=0.8),
           AdamParams(learning_rate=5e-3, weight_decay=0.1)]
    runtimes = [build_runtime(model_dir, tp) for _ in range(2)]
    units = [[rt.create_adapter(spec) for spec in specs] for rt in runtimes]
    out: dict = {"results": [], "states": []}
    for step in range(2):
        for rt, us in zip(runtimes, units):
            data = [make_data(10 * step + i, [7, 5], rt.config.vocab_size) for i in range(len(us))]
            res = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in zip(us, data)])
            assert not any(isinstance(r, Exception) for r in res), res
        alone = [runtimes[0].optim_step(u, hp) for u, hp in zip(units[0], hps)]
        together = runtimes[1].optim_steps(list(zip(units[1], hps)))
        out["results"].append(alone == together)
        same = []
        for a, b in zip(units[0], units[1]):
            (wa, oa), (wb, ob) = runtimes[0].export_full_state(a), runtimes[1].export_full_state(b)
            same.append(all(torch.equal(wa[k], wb[k]) for k in wa) and all(torch.equal(oa[k], ob[k]) for k in oa))
        out["states"].append(same)
    out["clipped"] = alone[0]["grad_norm"] > 0.05
    return out


def dimuon_scenario(rt: TrainingRuntime, sharded: bool) -> dict:
    """A Dimuon adapter (every linear layer and the unembedding): a loaded nonzero state, then two
    rounds of forward/backward and a clipped Dimuon step (the second builds on the first's
    momentum); its full-size weights and momentum after each, and logprobs at the end."""
    export = (lambda u: rt.export_full_state(u)) if sharded else (lambda u: rt.unit(u).export_state())
    unit = rt.create_adapter(LoraSpec(rank=4, seed=7), "dimuon")
    w, _ = export(unit)
    if sharded:
        rt.import_full_state(unit, _random_like(w, seed=100), None)
    else:
        rt.unit(unit).import_state(_random_like(w, seed=100), None)
    out: dict = {"steps": [], "states": []}
    for i in range(2):
        data = make_data(20 + i, [9, 5], rt.config.vocab_size)
        res = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))])
        assert not isinstance(res[0], Exception), res
        out["steps"].append(rt.optim_step(unit, DimuonParams(learning_rate=2e-2, grad_clip_norm=0.05)))
        out["states"].append(export(unit))
    again = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(make_data(1, [9], rt.config.vocab_size),
                                                                          "cross_entropy", forward_only=True))])
    out["logprobs_after"] = [o["logprobs"] for o in again[0].outputs]
    return out


def dimuon_rank_main(tp: TPGroup, model_dirs: list[str]) -> list[dict]:
    return [dimuon_scenario(build_runtime(d, tp), sharded=True) for d in model_dirs]


def rank_main(tp: TPGroup, cases: list[tuple[str, str, str]]) -> list[dict]:
    """Each rank: the scenario on every (model, save_to, load_from), sharded."""
    return [run_scenario(build_runtime(d, tp), sharded=True, save_to=s, load_from=l) for d, s, l in cases]


def fault_or_forward(rank: int, fault: str, stall_s: float, forward) -> dict | None:
    """Rank 1 ``fault``s ("raise", "exit" or "stall" for ``stall_s``) instead of joining the forward
    pass; rank 0 runs ``forward()`` (one request's forward_backward) and reports what it came to."""
    import os
    import time

    if rank == 1:
        if fault == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if fault == "exit":
            os._exit(3)
        time.sleep(stall_s)
        return None
    t0 = time.monotonic()
    (res,) = forward()
    return {"elapsed": time.monotonic() - t0, "type": type(res).__name__, "message": str(res)}


def assert_peer_fault_fails_rank0(main, model_dir, tmp_path, fault: str, timeout_s: float) -> dict:
    """Run ``main`` (a faulty_rank_main) on two ranks: rank 0's call fails with a ParallelError
    within the timeout, and rank 1 ended the way ``fault`` says; returns rank 0's report."""
    from tinsmith.parallel.launch import run_ranks

    rank0, rank1 = run_ranks(main, 2, tmp_path, (str(model_dir), fault, 1.5 * timeout_s),
                             timeout_s=timeout_s, deadline_s=60)
    assert rank0.exitcode == 0, rank0.error
    got = rank0.result
    assert got["type"] == "ParallelError", got
    assert "rank 0 of 2" in got["message"], got
    assert got["elapsed"] < timeout_s + 4.0, got  # slack for a loaded machine
    if fault == "raise":
        assert "rank 1 fails on purpose" in rank1.error
    elif fault == "exit":
        assert rank1.exitcode == 3
    return got


class StallingRank:
    """A group's target (``make_target``) whose :meth:`stall` keeps one rank away from the call's
    collectives for a while, as a hung rank would."""

    def __init__(self, tp: TPGroup, device: torch.device):
        self.tp = tp

    def stall(self, rank: int, seconds: float) -> int:
        import time

        if self.tp.rank == rank:
            time.sleep(seconds)
        return self.tp.rank


def faulty_rank_main(tp: TPGroup, model_dir: str, fault: str, stall_s: float) -> dict | None:
    """Both ranks load and shard the model; rank 1 then ``fault``s ("raise", "exit" or "stall")
    instead of joining the forward pass, and rank 0 reports what its forward pass came to."""
    rt = build_runtime(model_dir, tp)
    unit = rt.create_adapter(LoraSpec(rank=2, seed=0))
    return fault_or_forward(tp.rank, fault, stall_s, lambda: rt.forward_backward(
        [TrainRequest(unit, ForwardBackwardInput(make_data(1, [8], rt.config.vocab_size), "cross_entropy"))]))


class _FaultInjectingRuntime(TPTrainingRuntime):
    """The sharded runtime plus one call that fails on a single rank (to see the group notice)."""

    def fail_on_rank(self, rank: int) -> None:
        if self.tp.rank == rank:
            raise RuntimeError(f"injected failure on rank {rank}")


def spmd_calls(call, vocab: int) -> dict:
    """The calls a driver makes: create, load a state, a forward/backward with one refused request,
    a step, export; then a call every rank refuses alike."""
    out: dict = {}
    unit = call("create_adapter", LoraSpec(rank=4, seed=7))
    full, _ = call("export_full_state", unit)
    call("import_full_state", unit, _random_like(full, seed=100), None)
    bad = make_data(3, [4], vocab)
    bad[0].tokens[0] = vocab  # outside the vocabulary: refused alone, on every rank alike
    res = call("forward_backward", [TrainRequest(unit, ForwardBackwardInput(make_data(1, [9, 5], vocab), "cross_entropy")),
                                    TrainRequest(unit, ForwardBackwardInput(bad, "cross_entropy"))])
    out["logprobs"] = [o["logprobs"] for o in res[0].outputs]
    out["loss"] = res[0].metrics["loss:sum"]
    out["refused"] = type(res[1]).__name__
    out["step"] = call("optim_step", unit, AdamParams(learning_rate=1e-2, grad_clip_norm=0.05))
    out["after"] = call("export_full_state", unit)
    try:
        call("unit", 12345)
    except Exception as exc:  # noqa: BLE001 (which error is the point)
        out["missing_unit"] = type(exc).__name__
    return out


def spmd_main(tp: TPGroup, model_dir: str) -> dict:
    """Rank 0 drives through :class:`SpmdExecutor`; the other ranks follow."""
    from tinsmith.parallel.spmd import SpmdExecutor

    model = load_model(model_dir, "cpu", torch.float32).model
    rt = _FaultInjectingRuntime(shard_causal_lm(model, tp), logit_chunk_bytes=4 * model.config.vocab_size * 5)
    ex = SpmdExecutor(rt, tp)
    if not ex.is_driver:
        return {"calls": ex.follow()}
    out = spmd_calls(ex.call, rt.config.vocab_size)
    try:
        ex.call("fail_on_rank", 1)
    except Exception as exc:  # noqa: BLE001
        out["divergent"] = f"{type(exc).__name__}: {exc}"
    return out


def _group_sample_tasks(vocab: int) -> list:
    from tinsmith.sampling.sampler import SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    g = np.random.default_rng(6)
    return [SampleTask("base", None, SampleInput(g.integers(0, vocab, 6), 1, SamplingParams(max_tokens=5, temperature=0.0, stop=[]),
                                                 prompt_logprobs=True)),
            SampleTask("trained", 0, SampleInput(g.integers(0, vocab, 4), 2,
                                                 SamplingParams(max_tokens=5, temperature=1.0, seed=2, stop=[])))]


def _sample_summary(done: list) -> dict:
    out = {}
    for key, res in done:
        assert not isinstance(res, Exception), res
        out[key] = [(s.tokens.astype(np.int64), s.logprobs) for s in res.sequences]
        if res.prompt_logprobs is not None:
            out[key + ":prompt"] = res.prompt_logprobs[1:]
    return out


@dataclass
class GroupReference:
    """What one process computes for the calls a test drives a worker group with."""

    vocab: int
    calls: dict  # spmd_calls' results
    samples: dict  # the sampling tasks' tokens and logprobs, after those calls trained unit 0


def group_reference(model_dir: str) -> GroupReference:
    """:func:`spmd_calls` and then sampling (through the trained adapter too) in one process."""
    from tinsmith.sampling.sampler import Sampler

    rt = build_runtime(model_dir, None)
    vocab = rt.config.vocab_size
    plain = {"export_full_state": lambda u: rt.unit(u).export_state(),
             "import_full_state": lambda u, w, o: rt.unit(u).import_state(w, o)}
    calls = spmd_calls(lambda m, *a, **k: (plain[m] if m in plain else getattr(rt, m))(*a, **k), vocab)
    sampler = Sampler(rt.model, lambda ids: "")
    for t in _group_sample_tasks(vocab):
        sampler.add(t)
    done = []
    while sampler.has_work():
        done += sampler.step(budget_s=float("inf"))
    return GroupReference(vocab, calls, _sample_summary(done))


def assert_group_matches(group, ref: GroupReference) -> None:
    """A group of :class:`~tinsmith.parallel.worker.RankWorker` ranks, driven from rank 0, gives
    the one-process results; refused requests and a missing unit leave it healthy."""
    got = spmd_calls(lambda m, *a, **k: group.call("train", m, *a, **k), ref.vocab)
    assert group.healthy
    assert_same(ref.calls, got)
    assert_same(ref.samples, _sample_summary(group.call("sample", _group_sample_tasks(ref.vocab))))


def _full_lora(model, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random adapter tensors at full size for ``model`` (sharded or not), in a fixed order."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, layer in model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed):
        fin, fout = getattr(layer, "full_in", layer.in_features), getattr(layer, "full_out", layer.out_features)
        # Routed experts: one A/B per expert, all of them (a sharded layer holds its block of experts).
        experts = (getattr(layer, "full_experts", layer.num_experts),) if hasattr(layer, "num_experts") else ()
        out[f"{name}.lora_A.weight"] = 0.1 * torch.randn(*experts, spec.rank, fin, generator=g)
        out[f"{name}.lora_B.weight"] = 0.1 * torch.randn(*experts, fout, spec.rank, generator=g)
    return out


def sample_scenario(model_dir: str, tp: TPGroup | None, kv_layout: str = "auto", static: bool = False) -> list:
    """The serving sampler, whole or sharded: a greedy base-model request with prompt logprobs
    and a seeded, nucleus-sampled adapter request with two samples and top-k logprobs.
    ``static``: decode by the static step a CUDA graph records, run uncaptured (the step's
    tensors padded to a bucket of rows, K/V read up to the cache's capacity)."""
    from tinsmith.parallel.sampling import ShardedSampler, install_full_lora_weights
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams
    from tinsmith.worker.trainables import install_lora_weights

    model = load_model(model_dir, "cpu", torch.float32).model
    spec = LoraSpec(rank=4, seed=0)
    if tp is not None:
        shard_causal_lm(model, tp)
        install_full_lora_weights(model, 1, spec, _full_lora(model, spec, seed=9))
        sampler = ShardedSampler(model, lambda ids: "", kv_layout=kv_layout)
    else:
        install_lora_weights(model, 1, spec, _full_lora(model, spec, seed=9))
        sampler = Sampler(model, lambda ids: "", kv_layout=kv_layout)
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    # q/k/v and gate/up as one GEMM each at inference, the shards' rows packed as one process
    # packs the whole weights: the same layers take that path either way.
    packed = [m for layer in model.model.layers for m in (getattr(layer, "self_attn", None), layer.mlp,
                                                            getattr(layer.mlp, "shared_expert", None)) if m is not None]
    packed_paths = sorted(f"{type(m).__name__}.{a}" for m in packed for a in ("packed_qkv", "packed_gate_up")
                          if getattr(m, a, None) is not None and getattr(m, a).intact())
    g = np.random.default_rng(4)
    vocab = model.config.vocab_size
    sampler.add(SampleTask("base", None, SampleInput(g.integers(0, vocab, 7), 1,
                                                     SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                                                     prompt_logprobs=True, topk_prompt_logprobs=3)))
    sampler.add(SampleTask("lora", 1, SampleInput(g.integers(0, vocab, 5), 2,
                                                  SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3, stop=[]),
                                                  topk_sample_logprobs=2)))
    results = {}

    def drain() -> None:
        while sampler.has_work():
            for key, res in sampler.step(budget_s=3600.0):  # no time budget: every rank runs the same steps
                if isinstance(res, Exception):
                    raise res
                results[key] = res

    drain()
    # A 136-token prompt, then the same prompt extended: the second prefills only its last tokens,
    # reading the first one's K/V (this rank's heads) from the prefix cache (blocks of 16
    # positions, or two pages of 64 held in place by a paged cache).
    long = g.integers(0, vocab, 136)
    sampler.add(SampleTask("long", 1, SampleInput(long, 1, SamplingParams(max_tokens=4, temperature=0.0, stop=[]))))
    drain()
    sampler.add(SampleTask("longer", 1, SampleInput(np.concatenate([long, g.integers(0, vocab, 5)]), 1,
                                                    SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[]))))
    drain()
    out = [{"cached_prompt_tokens": torch.tensor(sampler.stats["cached_prompt_tokens"]), "packed": packed_paths}]
    if static:
        assert sampler.stats["static_steps"] == sampler.stats["decode_steps"] > 0, sampler.stats
    for key in ("base", "lora", "long", "longer"):
        r = results[key]
        out.append({"prompt_logprobs": None if r.prompt_logprobs is None else torch.from_numpy(r.prompt_logprobs[1:]),
                    "topk_prompt_ids": None if r.topk_prompt_token_ids is None else torch.from_numpy(r.topk_prompt_token_ids[1:]),
                    "sequences": [(torch.from_numpy(s.tokens.astype(np.int64)), torch.from_numpy(s.logprobs))
                                  for s in r.sequences]})
    return out


def fair_share_scenario(model_dir: str, tp: TPGroup | None) -> dict:
    """A key fills all four rows with long seeded generations; another key's request arrives and,
    having waited its turn, takes a row back (one row of the busy key's newest request). Every
    rank must take the same row at the same step: what each request sampled, and the counts."""
    from tests.sampling.conftest import scheduler_steps
    from tinsmith.parallel.sampling import ShardedSampler
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    model = load_model(model_dir, "cpu", torch.float32).model
    if tp is not None:
        shard_causal_lm(model, tp)
    sampler = (ShardedSampler if tp is not None else Sampler)(model, lambda ids: "", max_rows=4, prefix_cache_bytes=0)
    g = np.random.default_rng(8)
    vocab = model.config.vocab_size

    def task(key: str, owner: str, n: int, max_tokens: int, seed: int) -> SampleTask:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
        return SampleTask(key, None, SampleInput(g.integers(0, vocab, 6), n, params), owner)

    sampler.add(task("b0", "busy", 2, 160, 1))
    sampler.add(task("b1", "busy", 2, 160, 2))
    out: dict = {}
    steps = 0
    while sampler.has_work():
        if steps == 2:
            sampler.add(task("light", "light", 1, 4, 3))
        for key, res in scheduler_steps(sampler, 1).items():  # one decode step (admission first)
            if isinstance(res, Exception):
                raise res
            out[key] = {"tokens": [torch.from_numpy(q.tokens.astype(np.int64)) for q in res.sequences],
                        "logprobs": [torch.from_numpy(q.logprobs) for q in res.sequences],
                        "done_at": torch.tensor(sampler.stats["decode_steps"])}
        steps += 1
    out["yielded_rows"] = torch.tensor(sampler.stats["yielded_rows"])
    return out


def fair_share_rank_main(tp: TPGroup, model_dir: str) -> dict:
    return fair_share_scenario(model_dir, tp)


def inflight_scenario(model_dir: str, tp: TPGroup | None) -> dict:
    """An inflight sampler on a training run's live adapter, as the serving worker holds them (one
    model for the training runtime and the sampler): a greedy 136-token prompt, whose K/V the
    prefix cache keeps under the adapter's weights version; an optimizer step; the same prompt
    again, which must be computed with the new weights, not read from the cache. Also the
    version itself, before and after the step and after a load."""
    from tinsmith.parallel.sampling import ShardedSampler
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    rt = build_runtime(model_dir, tp)
    sampler = (ShardedSampler if tp is not None else Sampler)(rt.model, lambda ids: "")
    unit = rt.create_adapter(LoraSpec(rank=4, seed=7))
    slot = rt.unit(unit).slot
    export = (lambda: rt.export_full_state(unit)) if tp is not None else (lambda: rt.unit(unit).export_state())
    w, _ = export()
    load = rt.import_full_state if tp is not None else (lambda u, ws, o: rt.unit(u).import_state(ws, o))
    load(unit, _random_like(w, seed=5), None)  # B nonzero: the adapter steers the prompt's K/V
    versions = [rt.model.weights_version(slot)]
    prompt = np.random.default_rng(6).integers(0, rt.config.vocab_size, 136)

    def sample(key: str):
        sampler.add(SampleTask(key, slot, SampleInput(prompt, 1, SamplingParams(max_tokens=4, temperature=0.0, stop=[]))))
        while sampler.has_work():
            for _, res in sampler.step(budget_s=3600.0):
                if isinstance(res, Exception):
                    raise res
                seq = res.sequences[0]
                return torch.from_numpy(seq.tokens.astype(np.int64)), torch.from_numpy(seq.logprobs)

    out: dict = {"before": sample("before")}
    res = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(make_data(1, [9, 5], rt.config.vocab_size),
                                                                        "cross_entropy"))])
    assert not isinstance(res[0], Exception), res
    rt.optim_step(unit, AdamParams(learning_rate=5e-2))
    versions.append(rt.model.weights_version(slot))
    out["after_step"] = sample("after_step")
    out["cached_prompt_tokens"] = torch.tensor(sampler.stats["cached_prompt_tokens"])
    load(unit, _random_like(w, seed=6), None)
    versions.append(rt.model.weights_version(slot))
    out["after_load"] = sample("after_load")
    out["versions_changed"] = torch.tensor([b != a for a, b in zip(versions, versions[1:])])
    return out


def inflight_rank_main(tp: TPGroup, model_dir: str) -> dict:
    return inflight_scenario(model_dir, tp)


def sample_rank_main(tp: TPGroup, model_dir: str, kv_layout: str = "auto", gpu_paths: bool = False,
                     static: bool = False) -> list:
    if gpu_paths:
        take_gpu_paths()
    return sample_scenario(model_dir, tp, kv_layout, static)


def take_gpu_paths() -> None:
    """In this (rank) process, the paths bf16 on a GPU takes: experts (and several adapters) by
    the grouped matmul, decoding adapters through the banks."""
    from tinsmith.models import lora, moe

    moe.GROUPED_MM = "grouped"
    lora.DECODE_LORA = "bank"


def collective_counts(tp: TPGroup, model_dir: str) -> dict:
    """How many all-reduces / all-gathers a forward, a forward+backward and a step issue."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name in ("all_reduce", "all_gather", "broadcast"):
        original = getattr(dist, name)

        def counted(*a, _original=original, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*a, **k)

        setattr(dist, name, counted)  # this rank process only
    rt = build_runtime(model_dir, tp)
    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    data = make_data(1, [64], rt.config.vocab_size)
    out = {}
    for what, forward_only in (("forward", True), ("forward+backward", False)):
        counts.clear()
        rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", forward_only=forward_only))])
        out[what] = dict(counts)
    counts.clear()
    rt.optim_step(unit, AdamParams(learning_rate=1e-3))
    out["step"] = dict(counts)
    # Three adapters' steps taken together (tenants stepping in lockstep).
    more = [unit] + [rt.create_adapter(LoraSpec(rank=4, seed=s)) for s in (2, 3)]
    rt.forward_backward([TrainRequest(u, ForwardBackwardInput(data, "cross_entropy")) for u in more])
    counts.clear()
    results = rt.optim_steps([(u, AdamParams(learning_rate=1e-3)) for u in more])
    assert all(isinstance(r, dict) and r["grad_norm"] > 0 for r in results), results
    out["steps_together"] = dict(counts)
    return out


def host_waits_rank_main(tp: TPGroup, model_dir: str, kv_layout: str = "paged", gpu_paths: bool = False) -> dict:
    """What a sharded sampler's admission and decode bursts wait for on the host (see
    :mod:`tinsmith.devtools.host_syncs`), on this rank: {"admission"|"bursts": {site: count}}."""
    if gpu_paths:
        take_gpu_paths()
    from tinsmith.devtools.host_syncs import HostSyncs
    from tinsmith.parallel.sampling import ShardedSampler, install_full_lora_weights
    from tinsmith.sampling.sampler import SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    model = load_model(model_dir, "cpu", torch.float32).model
    spec = LoraSpec(rank=4, seed=0)
    shard_causal_lm(model, tp)
    install_full_lora_weights(model, 1, spec, _full_lora(model, spec, seed=9))
    sampler = ShardedSampler(model, lambda ids: "", kv_layout=kv_layout, decode_burst=4)
    g = np.random.default_rng(4)
    for i in range(4):
        sampler.add(SampleTask(f"r{i}", 1 if i % 2 else None, SampleInput(
            g.integers(0, model.config.vocab_size, 40 + 9 * i), 1 + i % 2,
            SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9 if i == 3 else 1.0, seed=i, stop=[]))))
    out = {}
    with torch.inference_mode():
        with HostSyncs() as h:
            sampler._admit([])
        out["admission"] = dict(h.by_site())
        sampler._decode_step([])
        with HostSyncs() as h:
            for _ in range(3):
                sampler._decode_step([])
        out["bursts"] = dict(h.by_site())
    return out
