"""Full fine-tuning on the device in bf16 with fp32 master weights: 20 steps at lr 1e-6 follow an
fp32 CPU run of the same weights and data, where bf16 weights alone would not move (the CPU
version of this check is tests/worker/test_precision.py; this one runs the device's kernels).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.worker.test_precision import STEPS, _data, _fb, _relative_error, _train
from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams
from tinsmith.worker.runtime import TrainingRuntime

pytestmark = pytest.mark.gpu


def _runtime(model_dir, device: str, dtype: torch.dtype, master_weights: bool = True) -> TrainingRuntime:
    """A full fine-tune on ``device`` in ``dtype``, from the bf16-rounded weights whatever the dtype."""
    model = load_model(str(model_dir), dtype=torch.float32).model
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return TrainingRuntime(model.to(device=device, dtype=dtype), full_finetune=True, master_weights=master_weights)


def _held(rt: TrainingRuntime) -> dict[str, torch.Tensor]:
    """What training holds (the fp32 masters when kept), on the host in fp32."""
    return {n: p.detach().float().cpu().clone() for n, p in rt.unit(0).named_stepped}


def test_bf16_on_the_device_with_fp32_masters_tracks_an_fp32_cpu_run(qwen3_dir):
    data = _data()
    ref = _runtime(qwen3_dir, "cpu", torch.float32)
    start = _held(ref)
    _train(ref, STEPS, data)
    want = _held(ref)

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    master = _runtime(qwen3_dir, DEVICE, dtype)
    _train(master, STEPS, data)
    got = _held(master)
    error = _relative_error(got, want, start)
    assert error < 0.25, f"the device's update strays from the fp32 CPU run's by {error:.3f}"

    if dtype == torch.bfloat16:  # and bf16 weights alone round the same updates away
        plain = _runtime(qwen3_dir, DEVICE, dtype, master_weights=False)
        _fb(plain, 0, data)
        plain.optim_step(0, AdamParams(learning_rate=1e-6))
        _train(plain, STEPS - 1, data)
        assert _relative_error(_held(plain), want, start) > 0.9
