"""A ``--dtype bfloat16`` server through the SDK: trains, samples with every sampling control, and
returns finite fp32 logprobs that agree with the fp32 server's within bf16 rounding."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, logprobs_of, repeated_pattern_batch

# bf16 keeps 8 bits of mantissa: hidden states and logits round at ~0.4% relative, and a logprob
# over a 512-token vocabulary (magnitude ~6) carries a few hundredths of that.
LP_ATOL = 0.05


@pytest.fixture(scope="module")
def bf16_server(make_server):
    return make_server(extra_args=["--dtype", "bfloat16"])


def _train_and_sample(service_client, srv, base_model):
    """One SFT step, a forward after it, then seeded samples at temperature 1 with top-k / top-p."""
    sc = service_client(srv=srv)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=7).result(timeout=RESULT_TIMEOUT_S)
    data = repeated_pattern_batch(3, 4, 24, VOCAB)
    fb = tc.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=RESULT_TIMEOUT_S)
    after = tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    prompt = types.ModelInput.from_ints(list(range(10, 22)))
    samples = {
        name: sampler.sample(prompt, 3, types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, **kw))
        .result(timeout=RESULT_TIMEOUT_S)
        for name, kw in {"plain": {}, "top_k": {"top_k": 20}, "top_p": {"top_p": 0.9},
                         "both": {"top_k": 50, "top_p": 0.8}}.items()
    }
    return sampler, logprobs_of(fb), logprobs_of(after), samples


def test_bf16_server_trains_and_samples_with_logprobs_close_to_fp32(service_client, server, bf16_server,
                                                                    base_model):
    _, fb32, after32, _ = _train_and_sample(service_client, server, base_model)
    sampler16, fb16, after16, samples16 = _train_and_sample(service_client, bf16_server, base_model)
    sampler32 = service_client(srv=server).create_sampling_client(
        base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    for a, b in zip(fb16 + after16, fb32 + after32):
        assert a.shape == b.shape and np.isfinite(a).all()
        assert not np.array_equal(a, b)  # the bf16 server really computed in bf16
        np.testing.assert_allclose(a, b, atol=LP_ATOL, rtol=0)
    for name, res in samples16.items():
        assert len(res.sequences) == 3
        for seq in res.sequences:
            lps = np.asarray(seq.logprobs)
            assert len(seq.tokens) == 8 and np.isfinite(lps).all() and (lps <= 0).all(), name
    # Seeded sampling answers the same tokens again in bf16.
    again = sampler16.sample(types.ModelInput.from_ints(list(range(10, 22))), 3,
                             types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, top_k=20)
                             ).result(timeout=RESULT_TIMEOUT_S)
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in samples16["top_k"].sequences]
    # The sampled tokens' logprobs agree with fp32 prompt logprobs of the same tokens (the base model
    # in fp32, the adapter after one small step: the step moves them far less than the tolerance).
    seq = samples16["plain"].sequences[0]
    tokens = list(range(10, 22)) + list(seq.tokens)
    ref = sampler32.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=RESULT_TIMEOUT_S)
    np.testing.assert_allclose(np.asarray(seq.logprobs), np.asarray(ref[12:], dtype=np.float64), atol=LP_ATOL * 2)
    assert_no_internal_errors(bf16_server.log_text())
