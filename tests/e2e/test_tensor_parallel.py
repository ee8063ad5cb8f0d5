"""A server with ``--tensor-parallel-size 2``, ``--data-parallel-size 2`` (two gloo processes on
the CPU) or both (four) driven by the real SDK gives what a one-process server gives, within 1e-5 in fp32:
LoRA training, sampler snapshots stored and in memory, greedy and seeded sampling, and
checkpoints saved and loaded."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, logprobs_of, lora_client, sft_batch

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 17, 99, 3, 250, 41])


def _samples(client) -> list:
    greedy = client.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, temperature=0.0),
                           include_prompt_logprobs=True).result(timeout=RESULT_TIMEOUT_S)
    seeded = client.sample(PROMPT, 3, types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)).result(
        timeout=RESULT_TIMEOUT_S)
    out = [np.asarray(greedy.prompt_logprobs[1:], dtype=np.float64)]
    for seq in greedy.sequences + seeded.sequences:
        out += [np.asarray(seq.tokens), np.asarray(seq.logprobs, dtype=np.float64)]
    return out


def _scenario(sc, base_model: str) -> list:
    """Train, snapshot, sample, save and load through one server; every number it produced."""
    tc = lora_client(sc, base_model, rank=4, seed=7)
    data = sft_batch(seed=3, n_seqs=3, seq_len=24, vocab=VOCAB)
    out = logprobs_of(tc.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=RESULT_TIMEOUT_S)
    trained = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    out += trained

    path = tc.save_weights_for_sampler("tp-sampler").result(timeout=RESULT_TIMEOUT_S).path
    out += _samples(sc.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S))
    out += _samples(tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S))
    out += _samples(sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S))

    state = tc.save_state("tp-state").result(timeout=RESULT_TIMEOUT_S).path
    resumed = sc.create_training_client_from_state_with_optimizer(state).result(timeout=RESULT_TIMEOUT_S)
    restored = logprobs_of(resumed.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    for a, b in zip(trained, restored):  # the checkpoint holds the weights as they were saved
        np.testing.assert_allclose(a, b, atol=1e-6)
    resumed.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=RESULT_TIMEOUT_S)
    out += logprobs_of(resumed.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    return out


@pytest.mark.parametrize("options, logged", [
    (["--tensor-parallel-size", "2"], "sharded over 2 tensor-parallel ranks"),
    (["--data-parallel-size", "2"], "replicated on 2 data-parallel ranks"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "each replica sharded over 2 tensor-parallel ranks"),
], ids=["tp2", "dp2", "dp2xtp2"])
def test_ranks_serve_what_one_process_serves(server, make_server, service_client, base_model, options, logged):
    tp = make_server(extra_args=[*options, "--device", "cpu"])
    assert logged in tp.log_text()  # the model really is sharded, or replicated
    one = _scenario(service_client(server), base_model)
    two = _scenario(service_client(tp), base_model)
    assert len(one) == len(two)
    for a, b in zip(one, two):
        assert a.shape == b.shape
        if a.dtype.kind in "iu":
            np.testing.assert_array_equal(a, b)  # the same tokens drawn
        else:
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert_no_internal_errors(tp.log_text())
