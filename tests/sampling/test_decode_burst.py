"""Decoding in bursts (several steps per read-back of the tokens, what GPUs do) gives the results
of reading back every step: same tokens, stop reasons and top-k ids, logprobs equal up to float
rounding (a row that stops inside a burst leaves the batch a few steps later, which changes the
batch's shapes, not any row's draws), for stop tokens met inside a burst, max_tokens, seeds,
greedy rows and mixed adapters."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sampling.conftest import decoder, fresh_model, mixed_tasks, random_adapter, run
from tinsmith.sampling.sampler import Sampler


def _tasks(vocab: int):
    return mixed_tasks(vocab, seed=7, stop_share=12)


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
