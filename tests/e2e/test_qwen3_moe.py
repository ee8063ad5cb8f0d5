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
from tests.e2e.helpers import (RESULT_TIMEOUT_S, gathered_logprobs, logprobs_of, lora_client,
                               repeated_pattern_batch, sft_batch, train_steps)
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
    tc = lora_client(sc, str(moe_model), rank=8, seed=3)
    losses = train_steps(tc, repeated_pattern_batch(seed=2, n_seqs=3, seq_len=24, vocab=VOCAB), 6, 1e-2)
    sampler_path = tc.save_weights_for_sampler("moe").result(timeout=RESULT_TIMEOUT_S).path
    yield {"sc": sc, "tc": tc, "losses": losses, "sampler_path": sampler_path}
    sc.close("success").result(timeout=10)


def test_lora_training_lowers_the_loss(trained):
    losses = trained["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_sampling_decodes_through_the_experts_consistently(trained):
    """Greedy tokens sampled step by step carry the logprobs a full forward pass gives them."""
    sampler = trained["sc"].create_sampling_client(model_path=trained["sampler_path"]).result(timeout=RESULT_TIMEOUT_S)
    prompt = types.ModelInput.from_ints([5, 17, 42, 99, 7, 64])
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    seq = sampler.sample(prompt, 1, params).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    assert len(seq.tokens) == 8 and seq.logprobs is not None
    full = prompt.to_ints() + list(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    forward = logprobs_of(trained["tc"].forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    np.testing.assert_allclose(seq.logprobs, forward[len(prompt.to_ints()) - 1:], rtol=1e-4, atol=1e-4)


def test_peft_export_reproduces_logprobs_in_transformers(trained, moe_server, moe_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir(moe_server, trained["sampler_path"])
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight" in names
    data = sft_batch(seed=77, n_seqs=3, seq_len=18, vocab=VOCAB)
    ours = logprobs_of(trained["tc"].forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    base = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32, experts_implementation="eager")
    ref = gathered_logprobs(PeftModel.from_pretrained(base, str(d)).eval(), data)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    plain = gathered_logprobs(AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32).eval(), data)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, plain)) > 1e-2  # the adapter matters
