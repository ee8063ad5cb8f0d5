"""A real SFT run's loss curve through the runtime equals transformers + peft's (bench/gpu/curves.py).

In fp32 on a CPU the runtime's every shortcut (packed micro-batches, several tenants' products in
one step, fused nodes, chunked logprobs, fused AdamW on masters) must give the plain path's curve
to float rounding, step after step, so the optimizer's semantics are checked too, not just one
forward/backward. In bf16 the curves must stray from the fp32 reference no further than the plain
path's own bf16 run does (the GPU target's rule, run here on the CPU's bf16 paths).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gpu import curves
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = TinyShape(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return make_tiny_model(tmp_path_factory.mktemp("curves") / "qwen3", "qwen3", shape, seed=3)


def test_docs_make_sft_data(model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert len(curves.doc_examples()) > 200  # the docs' paragraphs
    data = curves.sft_data(tok, 6, 40)
    assert len(data) == 6 and all(len(d.tokens) <= 40 for d in data)
    for d in data:
        w = d.loss_inputs["weights"]
        assert w.shape == d.loss_inputs["target_tokens"].shape == d.tokens.shape
        assert w[0] == 0 and w[-1] == 1 and np.all(np.diff(w) >= 0)  # the heading's tokens, then the paragraph's
    later = curves.sft_data(tok, 2, 40, skip=3)
    assert np.array_equal(later[0].tokens, data[3].tokens)


def test_fp32_curves_equal_peft(model_dir):
    r = curves.sft_curves(model_dir, torch.device("cpu"), quick=True, steps=5, rows=3, max_len=48, tenants=3,
                          learning_rate=3e-3)
    assert r["same_initial_weights"]
    c = r["curves"]
    assert len(c["tinsmith"]) == len(c["peft_fp32"]) == 5
    assert c["tinsmith"][0] == pytest.approx(c["peft_fp32"][0], rel=1e-6)
    assert r["max_rel_dev"]["tinsmith"] < 1e-5 and r["max_rel_dev"]["tinsmith_tenants"] < 1e-5
    assert r["tenants_vs_alone"] < 1e-5
    assert r["within_bf16_noise"] and r["worst_noise_ratio"] < 1


def test_training_moves_the_curve(model_dir):
    """The comparison means something only if the optimizer steps change the loss: the same
    datums at every step, and the loss falls well beyond the paths' agreement."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    data = curves.sft_data(tok, 2, 32)
    hp = curves.AdamParams(learning_rate=3e-3)
    run, initial = curves.tinsmith_run(model_dir, torch.device("cpu"), torch.float32, [{0: data}] * 4, hp)
    plain = curves.peft_run(model_dir, torch.device("cpu"), torch.float32, initial[0], [data] * 4, hp)
    assert run[0][-1] < run[0][0] - 0.05
    assert curves.max_rel_dev(run[0], plain) < 1e-5


def test_bf16_curves_within_noise(model_dir):
    r = curves.sft_curves(model_dir, torch.device("cpu"), quick=True, steps=4, rows=3, max_len=48, tenants=2,
                          learning_rate=3e-3, dtype=torch.bfloat16)
    assert r["dtype"] == "bfloat16"
    assert 0 < r["max_rel_dev"]["peft"] < 1e-2  # bf16 rounding shows, and stays small
    assert r["max_rel_dev"]["tinsmith_fp32"] < 1e-5
    assert r["within_bf16_noise"], r["max_rel_dev"]
