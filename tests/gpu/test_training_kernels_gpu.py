"""Training through the norm, rotary and SiLU-and-multiply kernels on the device: the loss and
every weight's gradient as through torch's operations, to fp32's noise in fp32, and in bf16 no
further from an fp32 run than torch's own bf16 operations are (the CPU version runs the kernels
in Triton's interpreter: tests/kernels/test_norm_grad.py)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.kernels.test_norm_grad import assert_kernels_called, train_both_ways
from tinsmith.kernels.lora_gather import triton_available

pytestmark = pytest.mark.gpu


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_through_the_kernels_matches_torch(family, model_dirs, monkeypatch):
    if DEVICE != "cuda" or not triton_available():
        pytest.skip("the kernels run on CUDA (the CPU runs them in the interpreter: tests/kernels)")
    fp32, counted, layers_ = train_both_ways(model_dirs[family], DEVICE, torch.float32, monkeypatch)
    assert_kernels_called(counted, layers_)
    (loss, got), (ref_loss, ref) = fp32["triton"], fp32["torch"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert set(got) == set(ref)
    for name, grad in got.items():
        assert _relative(grad, ref[name]) < 1e-4, name

    bf16, _, _ = train_both_ways(model_dirs[family], DEVICE, torch.bfloat16, monkeypatch)
    (k_loss, k_grads), (t_loss, t_grads) = bf16["triton"], bf16["torch"]
    assert abs(k_loss.item() - ref_loss.item()) <= 2 * abs(t_loss.item() - ref_loss.item()) + 1e-2
    for name, want in ref.items():
        kernels, torch_ops = _relative(k_grads[name], want), _relative(t_grads[name], want)
        assert kernels <= 1.5 * torch_ops + 1e-3, f"{name}: {kernels:.2e} from fp32, torch's bf16 {torch_ops:.2e}"
