"""Outside autograd a decoder layer leaves its last residual add to the next norm (one kernel for
both on a GPU, ``layers.add_rms_norm``); on the torch path that changes no arithmetic."""

from __future__ import annotations

import pytest
import torch

from tinsmith.models.layers import causal_attention
from tinsmith.models.loading import load_model


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5"])
def test_deferred_adds_give_the_hidden_states_of_one_layer_after_another(family, qwen3_dir, gpt_oss_dir,
                                                                         qwen3_5_dir):
    """Plain norms (Qwen3), gpt-oss' fp32-scaled ones and Qwen3.5's offset ones (which add, then
    normalise, in torch on every device): the same hidden states as each layer's whole output in
    turn, bit for bit."""
    model_dir = {"qwen3": qwen3_dir, "gpt_oss": gpt_oss_dir, "qwen3_5": qwen3_5_dir}[family]
    model = load_model(model_dir).model
    tokens = torch.randint(4, 400, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        h = model.model.embed_tokens(tokens)
        cos, sin = model.model.rotary(positions, h.dtype)
        for layer in model.model.layers:
            h = layer(h, cos, sin, None, causal_attention)
        want = model.model.norm(h)
        got = model.hidden_states(tokens, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
