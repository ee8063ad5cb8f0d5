"""A Qwen3.5 (hybrid Gated DeltaNet / attention) base model through the real server and the
unmodified SDK: LoRA training, a saved and reloaded state, sampling, and the PEFT export in peft."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import SMALL
from tests.e2e.helpers import (RESULT_TIMEOUT_S, assert_peft_export_matches, assert_sample_matches_forward,
                               logprobs_of, lora_round_trip, repeated_pattern_batch, sft_batch)
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
    data = repeated_pattern_batch(seed=2, n_seqs=3, seq_len=24, vocab=VOCAB)
    yield lora_round_trip(sc, str(hybrid_model), data, "hybrid", save_state=True)
    sc.close("success").result(timeout=60)


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
    datum = assert_sample_matches_forward(sampler, tc, types.ModelInput.from_ints([5, 17, 42, 99, 7, 64]),
                                          types.SamplingParams(max_tokens=8, temperature=0.0))
    forward = logprobs_of(tc.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    original = logprobs_of(trained["tc"].forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    np.testing.assert_allclose(forward, original, rtol=1e-5, atol=1e-5)  # the state came back whole


def test_peft_export_reproduces_logprobs_in_transformers(trained, hybrid_server, hybrid_model):
    from transformers import AutoModelForCausalLM

    assert_peft_export_matches(trained["tc"], checkpoint_dir(hybrid_server, trained["sampler_path"]),
                               sft_batch(seed=77, n_seqs=3, seq_len=18, vocab=VOCAB),
                               lambda: AutoModelForCausalLM.from_pretrained(str(hybrid_model), dtype=torch.float32))
