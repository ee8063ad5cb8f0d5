"""The fused gated-delta-rule decode step on the GPU: Qwen3.5's real layer shape (16 key heads,
32 value heads of 128 x 128) at 64 rows against the torch step, and a hybrid model's sampler
decoding through it as through torch."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import assert_kernel_samples_as_torch
from tests.kernels.test_delta_rule import case
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import delta_rule as dr
from tinsmith.kernels import lora_gather
from tinsmith.models.gated_deltanet import recurrent_gated_delta_step
from tinsmith.models.loading import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_here():
    if torch.device(DEVICE).type == "cuda" and dr.triton is None:
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]')")
    if torch.device(DEVICE).type == "cpu" and not lora_gather.triton_interpreting():
        pytest.skip("on a CPU the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_layer_shape_matches_the_torch_step(dtype):
    rows = 64 if DEVICE == "cuda" else 2
    q, k, v, g, beta, state = case(dtype, DEVICE, b=rows, hk=16, hv=32, dk=128, dv=128)
    want_out, want_state = recurrent_gated_delta_step(q, k, v, g, beta, state.clone())
    out = dr.decode_step_(q, k, v, g, beta, state)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)


def test_a_hybrid_sampler_decodes_through_the_kernel_as_through_torch(tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "qwen3_5", "qwen3_5", SMALL, seed=1)
    model = load_model(str(model_dir), device=DEVICE, dtype=torch.float32).model
    assert_kernel_samples_as_torch(model, dr, [6 + 30 * i for i in range(4)], 25, monkeypatch)
