"""Training through the unmodified ``tinker`` 0.38 SDK against the real server process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (
    gathered_logprobs,
    RESULT_TIMEOUT_S,
    logprobs_of,
    lora_client,
    loss_sum,
    random_tokens,
    repeated_pattern_batch,
    sft_batch,
    sft_datum,
    train_steps,
)

pytestmark = pytest.mark.e2e


def _reference_logprobs(model_dir, data: list[types.Datum]) -> list[np.ndarray]:
    """log p(target | prefix) from ``transformers`` on the same checkpoint, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    return gathered_logprobs(model, data)


def test_fresh_adapter_forward_matches_transformers(sc, base_model, tiny_model):
    tc = lora_client(sc, base_model, rank=8, seed=3)
    rng = np.random.default_rng(0)
    data = [sft_datum(random_tokens(rng, n + 1, VOCAB)) for n in (7, 20, 33)]
    out = tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    ours = logprobs_of(out)
    ref = _reference_logprobs(tiny_model, data)
    assert [a.shape for a in ours] == [(7,), (20,), (33,)]
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=0)
    # cross_entropy with unit weights: the loss is minus the summed target logprobs.
    assert loss_sum(out) == pytest.approx(-sum(float(b.sum()) for b in ref), rel=1e-4)


def test_sft_loss_falls(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=0)
    data = repeated_pattern_batch(seed=1, n_seqs=4, seq_len=32, vocab=VOCAB)
    losses = train_steps(tc, data, steps=10, lr=5e-3)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_two_dimensional_targets(sc, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=5)
    rng = np.random.default_rng(7)
    n, k = 12, 3
    tokens = random_tokens(rng, n, VOCAB)
    targets = rng.integers(0, VOCAB, (n, k)).astype(np.int64)
    weights = np.ones((n, k), dtype=np.float32)
    datum_2d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets),
                        "weights": types.TensorData.from_numpy(weights)},
    )
    out = tc.forward([datum_2d], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    lp2d = logprobs_of(out)[0]
    assert lp2d.shape == (n, k)
    assert np.all(lp2d < 0)

    columns = [
        types.Datum(model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={"target_tokens": targets[:, j].tolist(), "weights": [1.0] * n})
        for j in range(k)
    ]
    out_1d = tc.forward(columns, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    for j, lp in enumerate(logprobs_of(out_1d)):
        assert lp.shape == (n,)
        np.testing.assert_allclose(lp2d[:, j], lp, rtol=1e-5, atol=1e-6)

    # forward_backward takes the same (N, K) targets; loss is minus their summed logprobs
    fb = tc.forward_backward([datum_2d], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    np.testing.assert_allclose(logprobs_of(fb)[0], lp2d, rtol=1e-5, atol=1e-6)
    elementwise = np.asarray(fb.loss_fn_outputs[0]["elementwise_loss"].to_numpy())
    assert elementwise.shape == (n, k)
    assert loss_sum(fb) == pytest.approx(-float(lp2d.sum()), rel=1e-4)


def test_gradient_accumulation_matches_one_combined_call(sc, base_model):
    part_a = sft_batch(seed=30, n_seqs=2, seq_len=24, vocab=VOCAB)
    part_b = sft_batch(seed=31, n_seqs=2, seq_len=17, vocab=VOCAB)
    both = part_a + part_b
    adam = types.AdamParams(learning_rate=1e-2)

    def run(calls: list[list[types.Datum]]) -> float:
        """Two rounds of (forward_backward per call, one optim_step); then the loss on ``both``."""
        tc = lora_client(sc, base_model, rank=4, seed=11)
        for _ in range(2):
            futures = [tc.forward_backward(c, "cross_entropy") for c in calls]
            opt = tc.optim_step(adam)
            [f.result(timeout=RESULT_TIMEOUT_S) for f in futures]
            opt.result(timeout=RESULT_TIMEOUT_S)
        return loss_sum(tc.forward(both, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))

    accumulated = run([part_a, part_b])
    combined = run([both])
    only_b = run([part_b])  # control: losing part A's gradient must be visible
    assert accumulated == pytest.approx(combined, rel=1e-4)
    assert abs(only_b - combined) > 1e-3 * abs(combined), (only_b, combined)


def test_interleaved_tenants_do_not_leak(sc, service_client, base_model):
    data_a = sft_batch(seed=40, n_seqs=3, seq_len=20, vocab=VOCAB)
    data_b = repeated_pattern_batch(seed=41, n_seqs=2, seq_len=28, vocab=VOCAB)
    steps = 4

    alone_a = train_steps(lora_client(sc, base_model, rank=4, seed=21), data_a, steps)
    alone_b = train_steps(lora_client(sc, base_model, rank=8, seed=22), data_b, steps)

    # the same runs again, on fresh clients of two sessions, every step submitted interleaved
    tc_a = lora_client(service_client(), base_model, rank=4, seed=21)
    tc_b = lora_client(service_client(), base_model, rank=8, seed=22)
    inter_a, inter_b = [], []
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(steps):
        fa = tc_a.forward_backward(data_a, "cross_entropy")
        fb = tc_b.forward_backward(data_b, "cross_entropy")
        oa, ob = tc_a.optim_step(adam), tc_b.optim_step(adam)
        inter_a.append(loss_sum(fa.result(timeout=RESULT_TIMEOUT_S)))
        inter_b.append(loss_sum(fb.result(timeout=RESULT_TIMEOUT_S)))
        oa.result(timeout=RESULT_TIMEOUT_S)
        ob.result(timeout=RESULT_TIMEOUT_S)

    assert alone_a[-1] < alone_a[0] and alone_b[-1] < alone_b[0]  # both really trained
    np.testing.assert_allclose(inter_a, alone_a, rtol=1e-5)
    np.testing.assert_allclose(inter_b, alone_b, rtol=1e-5)


def test_call_split_into_chunks_by_the_sdk(sc, base_model):
    """More datums than the SDK's chunk length (1024): one call becomes two requests, sent
    concurrently with the first chunk last; the merged result keeps every datum in place."""
    tc = lora_client(sc, base_model, rank=4, seed=6)
    data = sft_batch(seed=60, n_seqs=1030, seq_len=3, vocab=VOCAB)
    whole = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    assert len(whole) == 1030
    picks = [0, 1, 511, 1023, 1024, 1029]  # both ends of both chunks
    alone = logprobs_of(tc.forward([data[i] for i in picks], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    np.testing.assert_allclose(np.stack([whole[i] for i in picks]), np.stack(alone), rtol=1e-6, atol=1e-6)
