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


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_several_tenants_side_by_side_through_the_kernels_match_the_loop(family, model_dirs, monkeypatch):
    """Three tenants in one bf16 step the device's way (grouped on Hopper: q/k/v and gate/up side
    by side, the base one GEMM over the packed weight, q/k read in the wide row by the norm/rotary
    kernels, gate/up by the side-by-side SiLU kernel) are no further from an fp32 step than each
    tenant's GEMMs in turn in bf16 are: logprobs and every adapter's gradients."""
    import numpy as np

    from tests.models.test_grouped_lora import _step
    from tinsmith.models import lora_tenants, moe

    if DEVICE != "cuda" or not triton_available():
        pytest.skip("the kernels run on CUDA (the CPU runs them in the interpreter: tests/kernels)")
    if not moe.grouped_mm_fits(torch.empty(0, device=DEVICE, dtype=torch.bfloat16), torch.bfloat16, 64, 64):
        pytest.skip("the grouped matmul is not fast here: several tenants run adapter by adapter")
    ref_results, ref_grads = _step(model_dirs[family], "loop", monkeypatch, device=DEVICE, dtype=torch.float32)
    loop = _step(model_dirs[family], "loop", monkeypatch, device=DEVICE, dtype=torch.bfloat16)
    packed: list = []
    real = lora_tenants.TenantsGroupFunction.apply
    monkeypatch.setattr(lora_tenants.TenantsGroupFunction, "apply", lambda *a: packed.append(a[4] is not None)
                        or real(*a))
    grouped = _step(model_dirs[family], "auto", monkeypatch, device=DEVICE, dtype=torch.bfloat16)
    assert packed and all(packed)

    def logprob_error(results) -> float:
        return max(float(np.abs(np.asarray(x["logprobs"]) - np.asarray(y["logprobs"])).max())
                   for a, b in zip(results, ref_results) for x, y in zip(a.outputs, b.outputs))

    assert logprob_error(grouped[0]) <= 1.5 * logprob_error(loop[0]) + 1e-2
    assert set(grouped[1]) == set(loop[1]) == set(ref_grads)
    for key, want in ref_grads.items():
        side_by_side, in_turn = _relative(grouped[1][key], want), _relative(loop[1][key], want)
        assert side_by_side <= 1.5 * in_turn + 1e-3, f"{key}: {side_by_side:.2e} from fp32, in turn {in_turn:.2e}"
