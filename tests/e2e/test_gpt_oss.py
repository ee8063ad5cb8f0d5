"""A gpt-oss base model through the real server and the unmodified SDK: LoRA training on
attention and every expert, sampling past the sliding window from the trained adapter, the
harmony chat template, and the adapter's PEFT export in peft."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tinker
import torch
from safetensors import safe_open
from tinker import types
from transformers import AutoTokenizer

from tests.conftest import SMALL
from tests.e2e.helpers import (RESULT_TIMEOUT_S, assert_peft_export_matches, assert_sample_matches_forward,
                               lora_round_trip, repeated_pattern_batch, sft_batch)
from tests.e2e.server import ServerProcess
from tests.rl.helpers import checkpoint_dir
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*_pattern keys did not match.*:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

VOCAB = SMALL.vocab_size
KEY = "tml-e2e-gpt-oss"


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e2e-gpt-oss") / "gpt_oss", "gpt_oss", SMALL, seed=1)


@pytest.fixture(scope="module")
def gpt_oss_server(gpt_oss_model, tmp_path_factory):
    srv = ServerProcess(gpt_oss_model, tmp_path_factory.mktemp("e2e-gpt-oss-data")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(gpt_oss_server, gpt_oss_model):
    sc = tinker.ServiceClient(base_url=gpt_oss_server.base_url, api_key=KEY)
    # Rows longer than the 16-token window, so training runs through the sliding layer's mask.
    data = repeated_pattern_batch(seed=2, n_seqs=3, seq_len=40, vocab=VOCAB)
    yield lora_round_trip(sc, str(gpt_oss_model), data, "gpt-oss")
    sc.close("success").result(timeout=60)


def test_lora_training_lowers_the_loss(trained):
    losses = trained["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_sampling_past_the_window_equals_the_full_forward(trained):
    """A prompt longer than the sliding window, decoded through the KV cache: every sampled
    token's logprob is what a full forward pass over the whole sequence gives it."""
    sampler = trained["sc"].create_sampling_client(model_path=trained["sampler_path"]).result(timeout=RESULT_TIMEOUT_S)
    prompt = types.ModelInput.from_ints(np.random.default_rng(4).integers(4, VOCAB, 2 * SMALL.sliding_window + 3).tolist())
    for params in (types.SamplingParams(max_tokens=20, temperature=0.0),
                   types.SamplingParams(max_tokens=20, temperature=1.0, seed=7)):
        assert_sample_matches_forward(sampler, trained["tc"], prompt, params)


def test_chat_renders_the_harmony_template(gpt_oss_server, gpt_oss_model):
    tok = AutoTokenizer.from_pretrained(str(gpt_oss_model))
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is two plus two?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|start|>system<|message|>") and rendered.endswith("<|start|>assistant")
    with openai.OpenAI(base_url=gpt_oss_server.base_url + "/oai/api/v1", api_key=KEY, max_retries=0,
                       timeout=RESULT_TIMEOUT_S) as oai:
        r = oai.chat.completions.create(model=str(gpt_oss_model), messages=messages, max_completion_tokens=5,
                                        temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert r.usage.completion_tokens == 5


def test_peft_export_reproduces_logprobs_in_transformers(trained, gpt_oss_server, gpt_oss_model):
    from transformers import AutoModelForCausalLM

    d = checkpoint_dir(gpt_oss_server, trained["sampler_path"])
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight" in names  # gate_up_proj
    assert_peft_export_matches(trained["tc"], d, sft_batch(seed=77, n_seqs=3, seq_len=40, vocab=VOCAB),
                               lambda: AutoModelForCausalLM.from_pretrained(str(gpt_oss_model), dtype=torch.float32,
                                                                            experts_implementation="eager"))
