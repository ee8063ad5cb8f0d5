"""A Qwen3.5 (hybrid Gated DeltaNet / attention) base model through the real server and the
unmodified SDK: LoRA training, a saved and reloaded state, sampling, and the PEFT export in peft."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import SMALL
from tests.e2e.helpers import (RESULT_TIMEOUT_S, gathered_logprobs, logprobs_of, lora_client,
                               repeated_pattern_batch, sft_batch, train_steps)
from tests.e2e.server import ServerProcess
from tests.rl.helpers import checkpoint_dir
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

VOCAB = SMALL.vocab_size


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e2e-qwen3_5") / "qwen3_5", "qwen3_5", SMALL, seed=1)


@pytest.fixture(scope="module")
def hybrid_server(hybrid_model, tmp_path_factory):
    srv = ServerProcess(hybrid_model, tmp_path_factory.mktemp("e2e-qwen3_5-data")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(hybrid_server, hybrid_model):
    sc = tinker.ServiceClient(base_url=hybrid_server.base_url, api_key="tml-e2e-qwen3_5")
    tc = lora_client(sc, str(hybrid_model), rank=8, seed=3)
    losses = train_steps(tc, repeated_pattern_batch(seed=2, n_seqs=3, seq_len=24, vocab=VOCAB), 6, 1e-2)
    state_path = tc.save_state("hybrid-state").result(timeout=RESULT_TIMEOUT_S).path
    sampler_path = tc.save_weights_for_sampler("hybrid").result(timeout=RESULT_TIMEOUT_S).path
    yield {"sc": sc, "tc": tc, "losses": losses, "state_path": state_path, "sampler_path": sampler_path}
    sc.close("success").result(timeout=10)


def test_capabilities_list_the_model(hybrid_server, hybrid_model):
    rest = tinker.RestClient(base_url=hybrid_server.base_url, api_key="tml-e2e-qwen3_5")
    caps = rest.get_server_capabilities().result(timeout=RESULT_TIMEOUT_S)
    assert [m.model_name for m in caps.supported_models] == [str(hybrid_model)]


def test_lora_training_lowers_the_loss(trained):
    losses = trained["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_reloaded_state_samples_what_a_forward_pass_scores(trained):
    """A training client made from the saved state samples greedily; each token's logprob is the
    one a full forward pass of the reloaded adapter gives it (prefill, recurrent decode and the
    chunked training forward agree)."""
    sc = trained["sc"]
    tc = sc.create_training_client_from_state(trained["state_path"]).result(timeout=RESULT_TIMEOUT_S)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    prompt = types.ModelInput.from_ints([5, 17, 42, 99, 7, 64])
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    seq = sampler.sample(prompt, 1, params).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    assert len(seq.tokens) == 8 and seq.logprobs is not None
    full = prompt.to_ints() + list(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    forward = logprobs_of(tc.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    np.testing.assert_allclose(seq.logprobs, forward[len(prompt.to_ints()) - 1:], rtol=1e-4, atol=1e-4)
    original = logprobs_of(trained["tc"].forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    np.testing.assert_allclose(forward, original, rtol=1e-5, atol=1e-5)  # the state came back whole


def test_peft_export_reproduces_logprobs_in_transformers(trained, hybrid_server, hybrid_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir(hybrid_server, trained["sampler_path"])
    data = sft_batch(seed=77, n_seqs=3, seq_len=18, vocab=VOCAB)
    ours = logprobs_of(trained["tc"].forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    base = AutoModelForCausalLM.from_pretrained(str(hybrid_model), dtype=torch.float32)
    ref = gathered_logprobs(PeftModel.from_pretrained(base, str(d)).eval(), data)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    plain = gathered_logprobs(AutoModelForCausalLM.from_pretrained(str(hybrid_model), dtype=torch.float32).eval(), data)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, plain)) > 1e-2  # the adapter matters
