"""What tinker-cookbook recipes send that a strict reading of the API would refuse.

* ``create_sampling_client(base_model=..., model_path=...)`` with both fields (distillation
  teachers, KL against a reference checkpoint, evaluators): the checkpoint decides, and a
  ``base_model`` that names another served model is refused naming both.
* Loss inputs a loss does not read (``advantages`` and ``logprobs`` passed along to
  ``cross_entropy``): accepted and ignored, whatever their shape; the keys the loss reads are
  still checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import SMALL
from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, logprobs_of, lora_client, loss_sum, sft_batch
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_model_server(make_server, tmp_path_factory):
    """A server holding two base models, so a mismatched base_model has somewhere to point."""
    other = make_tiny_model(tmp_path_factory.mktemp("other-base") / "llama", "llama", SMALL, seed=7)
    srv = make_server(extra_args=["--base-model", str(other)])
    return srv, str(other)


def _greedy(n: int = 6) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])


def test_sampling_client_with_both_base_model_and_model_path(two_model_server, service_client, base_model):
    srv, other_base = two_model_server
    sc = service_client(srv)
    tc = lora_client(sc, base_model, rank=4, seed=1)
    tc.forward_backward(sft_batch(seed=2, n_seqs=2, seq_len=16, vocab=VOCAB), "cross_entropy").result(
        timeout=RESULT_TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=RESULT_TIMEOUT_S)
    path = tc.save_weights_for_sampler("teacher").result(timeout=RESULT_TIMEOUT_S).path
    prompt = types.ModelInput.from_ints([5, 17, 33, 2, 9])

    alone = sc.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S)
    both = sc.create_sampling_client(base_model=base_model, model_path=path).result(timeout=RESULT_TIMEOUT_S)
    base = sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    want = alone.sample(prompt, 1, _greedy()).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    got = both.sample(prompt, 1, _greedy()).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    plain = base.sample(prompt, 1, _greedy()).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    assert got.tokens == want.tokens and got.logprobs == want.logprobs  # model_path wins
    assert not np.allclose(plain.logprobs, want.logprobs, atol=1e-4), "the trained adapter must differ from the base"

    # base_model naming another served model: refused, naming both models
    with pytest.raises(tinker.APIStatusError) as ei:
        sc.create_sampling_client(base_model=other_base, model_path=path).result(timeout=RESULT_TIMEOUT_S)
    assert 400 <= ei.value.status_code < 500
    assert other_base in str(ei.value) and base_model in str(ei.value), str(ei.value)
    assert_no_internal_errors(srv.log_text())


def test_cross_entropy_ignores_inputs_it_does_not_read(sc, server, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=2)
    plain = sft_batch(seed=3, n_seqs=3, seq_len=12, vocab=VOCAB)
    passed_along = []
    for i, d in enumerate(plain):
        n = len(d.loss_fn_inputs["target_tokens"].data)
        extra = {
            "advantages": [0.5] * n,  # RL fields a recipe forwards unchanged
            "logprobs": [-1.0] * n,
            # keys the SDK has no dtype for travel as TensorData; one is not even the datum's length
            "mask": types.TensorData.from_numpy(np.ones(n, np.float32)),
            "teacher_scores": types.TensorData.from_numpy(np.array([float(i)], np.float32)),
        }
        passed_along.append(types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, **extra}))

    ref = tc.forward(plain, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    fwd = tc.forward(passed_along, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    fb = tc.forward_backward(passed_along, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    for a, b in zip(logprobs_of(ref), logprobs_of(fwd)):
        np.testing.assert_array_equal(a, b)
    assert loss_sum(fb) == pytest.approx(loss_sum(ref), rel=1e-6)

    # The keys cross_entropy reads are still checked: weights of the wrong length are refused.
    n = len(plain[0].loss_fn_inputs["target_tokens"].data)
    bad = types.Datum(model_input=plain[0].model_input,
                      loss_fn_inputs={**passed_along[0].loss_fn_inputs, "weights": [1.0] * (n + 2)})
    with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as ei:
        tc.forward_backward([bad], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert "weights" in str(ei.value)
    assert_no_internal_errors(server.log_text())
