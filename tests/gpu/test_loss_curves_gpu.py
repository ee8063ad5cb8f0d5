"""Issue 14's exactness on the device: a LoRA SFT run's loss curves (three tenants stepping
together) on the device's fast paths (the training kernels, the fused LoRA nodes, the grouped
several-tenant matmuls, torch's fused AdamW, the block copies of the tenants' stacks) stay as close
to an fp32 run of the same data as the same run on torch's plain bf16 operations does: every speed
change keeps the curve within bf16's own noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gpu.train import batch
from tests.gpu.conftest import DEVICE
from tinsmith.kernels import block_copy, norm_grad, rms_norm, swiglu, vocab_softmax
from tinsmith.models import grouped_lora, lora_function
from tinsmith.models.loading import load_model
from tinsmith.optim import families
from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

pytestmark = pytest.mark.gpu

STEPS = 20
RANKS = (8, 16, 4)  # three tenants, ranks padded differently in the stacks


def _plain(monkeypatch) -> None:
    """torch's operations everywhere: no kernels, one autograd node per op, tenants one by one, foreach AdamW."""
    for module in (norm_grad, rms_norm, swiglu, vocab_softmax, block_copy):
        monkeypatch.setattr(module, "BACKEND", "torch")
    monkeypatch.setattr(lora_function, "FUSED_NODES", False)
    monkeypatch.setattr(grouped_lora, "MULTI_LORA", "loop")
    monkeypatch.setattr(families, "fused_adamw_fits", lambda params: False)


def _curves(model_dir, dtype: torch.dtype) -> np.ndarray:
    """(steps, tenants) summed losses of the three tenants trained together on their own data."""
    rt = TrainingRuntime(load_model(str(model_dir), device=DEVICE, dtype=dtype).model, max_lora_adapters=3,
                         max_lora_rank=16)
    units = [rt.create_adapter(LoraSpec(rank=r, seed=i)) for i, r in enumerate(RANKS)]
    data = [batch(rt.config.vocab_size, 2, 32, seed=i) for i in range(len(units))]
    out = []
    for _ in range(STEPS):
        results = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(d, "cross_entropy"))
                                       for u, d in zip(units, data)])
        out.append([r.metrics["loss:sum"] for r in results])
        steps = rt.optim_steps([(u, AdamParams(learning_rate=1e-2)) for u in units])
        assert not any(isinstance(s, Exception) for s in steps), steps
    return np.array(out)


def test_the_fast_paths_loss_curves_stay_within_bf16_noise(qwen3_dir, monkeypatch):
    half = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    fast = _curves(qwen3_dir, half)
    with monkeypatch.context() as m:
        _plain(m)
        plain = _curves(qwen3_dir, half)
        ref = _curves(qwen3_dir, torch.float32)
    assert np.isfinite(fast).all() and (ref[-1] < 0.5 * ref[0]).all(), ref  # the tenants do learn
    fast_dev, plain_dev = np.abs(fast - ref).mean(), np.abs(plain - ref).mean()
    assert fast_dev <= 2 * plain_dev + 1e-3 * np.abs(ref).mean(), (
        f"the fast paths stray {fast_dev:.4f} from the fp32 curves, torch's bf16 ops {plain_dev:.4f}")
