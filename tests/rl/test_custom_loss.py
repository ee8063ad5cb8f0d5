"""``forward_backward_custom``: a client-side torch loss through the unmodified SDK.

The SDK runs a forward pass, differentiates the user's loss with respect to the returned
logprobs, and sends ``cross_entropy`` with ``weights = -dL/dlogp``. So the server must return
exact logprobs and apply exactly that linear surrogate's gradient; these tests check both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, logprobs_of, lora_client

pytestmark = pytest.mark.e2e

BETA = 0.5
STEPS = 3
ADAM = types.AdamParams(learning_rate=5e-3)


def _pair() -> list[types.Datum]:
    """A preference pair: one prompt, a chosen and a rejected answer; weights mark the answers."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, VOCAB, 6).tolist()
    out = []
    for answer_len in (5, 7):
        full = prompt + rng.integers(0, VOCAB, answer_len).tolist()
        weights = [0.0] * (len(prompt) - 1) + [1.0] * answer_len
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
    return out


def dpo_loss(data: list[types.Datum], logprobs: list[torch.Tensor]):
    """-log sigmoid(beta * (log p(chosen) - log p(rejected))), the answers' tokens only."""
    seq = [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs)]
    margin = seq[0] - seq[1]
    loss = -torch.nn.functional.logsigmoid(BETA * margin)
    return loss, {"margin:mean": float(margin.detach())}


def mean_logprob_loss(data, logprobs):
    """A second, different loss (control): minus the mean of every target logprob."""
    return -torch.cat([lp.flatten() for lp in logprobs]).mean(), {}


def _surrogate_weights(data, logprobs_np, loss_fn) -> list[np.ndarray]:
    """-dL/dlogp at the given logprobs, exactly as the SDK computes it."""
    lps = [torch.tensor(lp, dtype=torch.float32, requires_grad=True) for lp in logprobs_np]
    loss, _ = loss_fn(data, lps)
    loss.backward()
    return [(-lp.grad).numpy().astype(np.float32) for lp in lps]


def test_custom_loss_value_matches_function_on_forward_logprobs(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=21)
    data = _pair()
    forward_lps = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    expected, metrics = dpo_loss(data, [torch.tensor(lp, dtype=torch.float32) for lp in forward_lps])
    out = tc.forward_backward_custom(data, dpo_loss).result(timeout=RESULT_TIMEOUT_S)
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    assert out.metrics["margin:mean"] == pytest.approx(metrics["margin:mean"], rel=1e-4, abs=1e-4)
    # the server's value of the linear surrogate, sum(-logp * w), is kept beside it
    w = _surrogate_weights(data, forward_lps, dpo_loss)
    surrogate = sum(float(-(lp * wi).sum()) for lp, wi in zip(forward_lps, w))
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(surrogate, rel=1e-4, abs=1e-5)
    for lp_out, lp_fwd in zip(logprobs_of(out), forward_lps):
        np.testing.assert_allclose(lp_out, lp_fwd, rtol=1e-5, atol=1e-6)


def _run_custom(sc, base_model, data, loss_fn) -> list[np.ndarray]:
    tc = lora_client(sc, base_model, rank=8, seed=22)
    for _ in range(STEPS):
        tc.forward_backward_custom(data, loss_fn).result(timeout=RESULT_TIMEOUT_S)
        tc.optim_step(ADAM).result(timeout=RESULT_TIMEOUT_S)
    return logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))


def _run_cross_entropy(sc, base_model, data, loss_fn) -> list[np.ndarray]:
    """The same steps done by hand: forward, local gradient, cross_entropy with weights -g."""
    tc = lora_client(sc, base_model, rank=8, seed=22)
    for _ in range(STEPS):
        lps = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
        weights = _surrogate_weights(data, lps, loss_fn)
        linear = [types.Datum(model_input=d.model_input,
                              loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w})
                  for d, w in zip(data, weights)]
        tc.forward_backward(linear, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        tc.optim_step(ADAM).result(timeout=RESULT_TIMEOUT_S)
    return logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))


def test_custom_loss_step_equals_cross_entropy_with_gradient_weights(sc, base_model):
    data = _pair()
    custom = _run_custom(sc, base_model, data, dpo_loss)
    by_hand = _run_cross_entropy(sc, base_model, data, dpo_loss)
    for a, b in zip(custom, by_hand):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # control: the steps really moved the model, and a different loss moves it differently
    fresh = lora_client(sc, base_model, rank=8, seed=22)
    start = logprobs_of(fresh.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    assert max(float(np.abs(a - s).max()) for a, s in zip(custom, start)) > 1e-2
    other = _run_custom(sc, base_model, data, mean_logprob_loss)
    assert max(float(np.abs(a - o).max()) for a, o in zip(custom, other)) > 1e-2
