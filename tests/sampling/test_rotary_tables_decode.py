"""The sampler's decode steps, eager and static (what a CUDA graph records), read their rotary
turns from the model's tables (tinsmith.models.layers.Rotary): made once for the model's context,
and sampling exactly what computing the turns samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sampling.conftest import fresh_model, run, task
from tinsmith.models.layers import Rotary
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.sampling.sampler import Sampler


def _sample(model, static: bool) -> tuple[dict, Sampler]:
    sampler = Sampler(model, lambda toks: "", max_rows=6, kv_layout="paged")
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    rng = np.random.default_rng(3)
    tasks = [task(f"t{i}", rng.integers(4, model.config.vocab_size, 5 + 6 * i).tolist(), n=2, max_tokens=20,
                  temperature=1.0, seed=i, stop=[]) for i in range(3)]
    tasks.append(task("greedy", rng.integers(4, model.config.vocab_size, 9).tolist(), max_tokens=15, temperature=0.0,
                      stop=[]))
    return run(sampler, tasks), sampler


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_steps_read_the_tables_and_sample_the_same(qwen3_dir, monkeypatch, static):
    model = fresh_model(qwen3_dir)
    rotary = model.model.rotary
    assert rotary.max_positions == model.config.max_position_embeddings
    real = Rotary.forward
    computed_only = lambda self, positions, dtype, tabled=False: real(self, positions, dtype)  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(Rotary, "forward", computed_only)
        ref, _ = _sample(model, static)
    assert rotary._tables == {}
    got, sampler = _sample(model, static)
    assert list(rotary._tables) == [(torch.device("cpu"), next(model.parameters()).dtype)]
    assert (sampler.stats.get("static_steps", 0) > 0) == static
    assert set(ref) == set(got)
    for key, res in ref.items():
        for a, b in zip(res.sequences, got[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            assert np.array_equal(a.logprobs, b.logprobs), key
            assert a.stop_reason == b.stop_reason, key
