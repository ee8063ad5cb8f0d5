"""Start-up warm-up: it runs sampling and training once, and leaves nothing behind."""

from __future__ import annotations

import logging

import numpy as np

from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.service import RuntimeOptions, Worker
from tinsmith.worker.warm_up import warm_up

SPEC = LoraSpec(rank=4, seed=7)


def _worker(qwen3_dir, warm: bool) -> Worker:
    w = Worker(RuntimeOptions())
    base = w.add_base_model(str(qwen3_dir))
    if warm:
        assert warm_up(w, base) > 0
        assert not base.lora.units and not w.sampler(base).has_work()
    return w


def _train_then_sample(w: Worker) -> tuple[list[float], list[int], list[float]]:
    name = next(iter(w.bases))
    placement = w.create_model("run", name, SPEC)
    tokens = np.arange(5, 45)
    datum = Datum(tokens=tokens[:-1], loss_inputs={"target_tokens": tokens[1:], "weights": np.ones(39, np.float32)})
    passes = w.fb_begin("run", [ForwardBackwardInput([datum], "cross_entropy")])
    while not passes.done:
        w.fb_advance([(passes, 1 << 30)], 1 << 30)
    (res,) = passes.results
    w.optim_step("run", AdamParams(learning_rate=1e-2))
    sampler = w.sampler(placement.base)
    sampler.add(SampleTask("s", placement.runtime.unit(placement.unit).slot, SampleInput(
        prompt=tokens[:8], num_samples=1, params=SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[]))))
    out = []
    while not out:
        out = sampler.step(1.0)
    seq = out[0][1].sequences[0]
    return list(res.outputs[0]["logprobs"]), list(seq.tokens), list(seq.logprobs)


def test_warm_up_leaves_training_and_sampling_as_on_a_fresh_worker(qwen3_dir):
    cold = _train_then_sample(_worker(qwen3_dir, warm=False))
    warm = _train_then_sample(_worker(qwen3_dir, warm=True))
    np.testing.assert_allclose(warm[0], cold[0], rtol=1e-6)
    assert warm[1] == cold[1]
    np.testing.assert_allclose(warm[2], cold[2], rtol=1e-5, atol=1e-6)


def test_server_start_up_logs_the_warm_up(qwen3_dir, tmp_path, caplog):
    from tinsmith.server.config import ServerConfig
    from tinsmith.server.state import ServerState

    caplog.set_level(logging.INFO)
    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)], data_dir=str(tmp_path)))
    try:
        state.prepare()
    finally:
        state.release()
        state.store.close()
    assert any("warm-up of" in r.getMessage() and "ran once in" in r.getMessage() for r in caplog.records)


def test_warm_up_chooses_tokens_every_way(qwen3_dir, monkeypatch):
    """Truncated (top-p), plain-temperature and all-greedy steps each run once at start-up: on a
    GPU the latter two choose through a kernel that is built on first use."""
    from tinsmith.sampling import sampler as sampler_module

    seen = set()
    real = sampler_module.choose_tokens

    def spy(logits, temperature, top_k, top_p, u, kinds=None, **kw):
        seen.add("greedy" if kinds.all_greedy else "truncated" if kinds.truncating is not None else "plain")
        return real(logits, temperature, top_k, top_p, u, kinds, **kw)

    monkeypatch.setattr(sampler_module, "choose_tokens", spy)
    _worker(qwen3_dir, warm=True)
    assert seen == {"greedy", "truncated", "plain"}
