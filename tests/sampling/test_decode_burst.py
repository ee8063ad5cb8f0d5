"""Decoding in bursts (several steps per read-back of the tokens, what GPUs do) gives the results
of reading back every step: same tokens, stop reasons and top-k ids, logprobs equal up to float
rounding (a row that stops inside a burst leaves the batch a few steps later, which changes the
batch's shapes, not any row's draws), for stop tokens met inside a burst, max_tokens, seeds,
greedy rows and mixed adapters."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sampling.conftest import decoder, fresh_model, random_adapter, run, task
from tinsmith.sampling.sampler import Sampler


def _tasks(vocab: int):
    rng = np.random.default_rng(7)
    stops = sorted(rng.choice(np.arange(4, vocab), size=vocab // 12, replace=False).tolist())
    prompts = [rng.integers(4, vocab, n).tolist() for n in (5, 11, 8, 3, 14)]
    return [
        task("stop-tokens", prompts[0], n=3, max_tokens=40, temperature=1.0, seed=1, stop=stops),
        task("greedy-stops", prompts[1], max_tokens=33, temperature=0.0, stop=stops[::2]),
        task("adapter-a", prompts[2], slot=1, n=2, max_tokens=17, temperature=0.8, top_p=0.9, seed=3, stop=stops,
             topk_sample_logprobs=3),
        task("adapter-b", prompts[3], slot=2, max_tokens=9, temperature=1.0, top_k=20, seed=4, stop=[]),
        task("long", prompts[4], max_tokens=50, temperature=1.0, seed=5, stop=[], topk_sample_logprobs=2),
    ]


@pytest.mark.parametrize("burst", [3, 8])
def test_bursts_sample_what_single_steps_sample(qwen3_dir, burst):
    results = {}
    for k in (1, burst):
        model = fresh_model(qwen3_dir)
        random_adapter(model, 1, seed=1)
        random_adapter(model, 2, rank=8, seed=2)
        sampler = Sampler(model, decoder(qwen3_dir), decode_burst=k)
        results[k] = run(sampler, _tasks(model.config.vocab_size))
        reads = sampler.stats["decode_reads"]
        assert reads == sampler.stats["decode_steps"] if k == 1 else reads < sampler.stats["decode_steps"] / 2
    one, many = results[1], results[burst]
    reasons = set()
    for key, res in one.items():
        assert not isinstance(res, Exception), res
        for a, b in zip(res.sequences, many[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
            assert a.stop_reason == b.stop_reason, key
            reasons.add(a.stop_reason)
            if a.topk_token_ids is not None:
                np.testing.assert_array_equal(a.topk_token_ids, b.topk_token_ids)
                np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=1e-5, atol=1e-6)
    assert reasons == {"stop", "length"}
