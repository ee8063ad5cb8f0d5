"""Packed attention on the GPU: torch's varlen attention (Flash) gives what causal SDPA per document
gives, forward and backward, with grouped-query heads and sliding windows, in bf16; and a packed
training step equals a padded one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models import document_attention
from tinsmith.models.document_attention import DocumentAttention
from tinsmith.models.layers import causal_attention
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

pytestmark = pytest.mark.gpu

BOUNDS = [0, 130, 131, 400, 1024]


def _qkv(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, 8, BOUNDS[-1], 64, device=DEVICE, dtype=dtype, generator=g)
    k, v = (torch.randn(1, 2, BOUNDS[-1], 64, device=DEVICE, dtype=dtype, generator=g) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize("window", [None, 64])
def test_varlen_attention_equals_per_document_sdpa(window):
    if DEVICE != "cuda" or document_attention._varlen() is None:
        pytest.skip("needs CUDA and torch.nn.attention.varlen")
    q, k, v = _qkv(torch.bfloat16)
    backend = DocumentAttention(BOUNDS)
    assert backend._varlen_applies(q, None, window)
    out = backend(0, q, k, v, window=window)
    ref = torch.cat([causal_attention(0, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], window=window)
                     for a, b in zip(BOUNDS, BOUNDS[1:])], dim=2)
    assert_rel_close(out.float(), ref.float(), 2e-2, "output")
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_rel_close(a.float(), b.float(), 3e-2, name)


def test_packed_step_equals_padded_on_the_device(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1, dtype="bfloat16")
    rng = np.random.default_rng(0)
    data = [sft_datum(rng, n, SMALL.vocab_size) for n in (5, 200, 37, 120)]
    out = {}
    for packing in (False, True):
        rt = TrainingRuntime(load_model(str(model_dir), device=DEVICE).model, packing=packing)
        u = rt.create_adapter(LoraSpec(rank=8, seed=3))
        (res,) = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(data, "cross_entropy"))])
        out[packing] = (res, {n: p.grad.float() for n, p in rt.unit(u).named_params if p.grad is not None})
    (padded, g_padded), (packed, g_packed) = out[False], out[True]
    for a, b in zip(packed.outputs, padded.outputs):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=0.1)
    for n in g_padded:
        assert_rel_close(g_packed[n], g_padded[n], 5e-2, n)
