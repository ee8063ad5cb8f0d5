"""A Qwen3-MoE base model through the real server and the unmodified SDK: LoRA training on
attention and every expert, sampling from the trained adapter, and its PEFT export in peft."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from safetensors import safe_open

from tests.conftest import SMALL
from tests.e2e.helpers import (RESULT_TIMEOUT_S, assert_peft_export_matches, assert_sample_matches_forward,
                               lora_round_trip, repeated_pattern_batch, sft_batch)
from tests.e2e.server import ServerProcess
from tests.rl.helpers import checkpoint_dir
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*_pattern keys did not match.*:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

VOCAB = SMALL.vocab_size


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e2e-moe") / "qwen3_moe", "qwen3_moe", SMALL, seed=1)


@pytest.fixture(scope="module")
def moe_server(moe_model, tmp_path_factory):
    srv = ServerProcess(moe_model, tmp_path_factory.mktemp("e2e-moe-data")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(moe_server, moe_model):
    sc = tinker.ServiceClient(base_url=moe_server.base_url, api_key="tml-e2e-moe")
    data = repeated_pattern_batch(seed=2, n_seqs=3, seq_len=24, vocab=VOCAB)
    yield lora_round_trip(sc, str(moe_model), data, "moe")
    sc.close("success").result(timeout=60)


def test_lora_training_lowers_the_loss(trained):
    losses = trained["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_sampling_decodes_through_the_experts_consistently(trained):
    """Greedy tokens sampled step by step carry the logprobs a full forward pass gives them."""
    sampler = trained["sc"].create_sampling_client(model_path=trained["sampler_path"]).result(timeout=RESULT_TIMEOUT_S)
    assert_sample_matches_forward(sampler, trained["tc"], types.ModelInput.from_ints([5, 17, 42, 99, 7, 64]),
                                  types.SamplingParams(max_tokens=8, temperature=0.0))


def test_peft_export_reproduces_logprobs_in_transformers(trained, moe_server, moe_model):
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir(moe_server, trained["sampler_path"])
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight" in names
    assert_peft_export_matches(trained["tc"], d, sft_batch(seed=77, n_seqs=3, seq_len=18, vocab=VOCAB),
                               lambda: AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32,
                                                                            experts_implementation="eager"))
