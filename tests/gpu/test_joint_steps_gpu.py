"""On the GPU: several tenants' optimizer steps taken together (torch's fused AdamW on the device)
leave each adapter bit-identical to its step alone, and wait for the device once
(tests/worker/test_joint_steps.py checks the same on the CPU, the fused kernel forced there)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.gpu.test_host_syncs_gpu import waits
from tests.worker.test_joint_steps import HPS, _backward, _runtime, assert_joint_equals_alone
from tinsmith.optim import families

pytestmark = pytest.mark.gpu


def _dtype() -> torch.dtype:
    return torch.bfloat16 if DEVICE == "cuda" else torch.float32


def test_joint_steps_equal_steps_alone_on_the_device(qwen3_dir):
    assert_joint_equals_alone(qwen3_dir, _dtype(), fused=families.fused_adamw_fits([torch.zeros(1, device=DEVICE)]),
                              device=DEVICE)


def test_joint_steps_wait_for_the_device_once(qwen3_dir):
    rt, units = _runtime(qwen3_dir, _dtype(), device=DEVICE)
    _backward(rt, units, 0)
    rt.optim_steps(list(zip(units, HPS)))  # the optimizer state made
    _backward(rt, units, 1)
    with waits() as found:
        results = rt.optim_steps(list(zip(units, HPS)))
    assert not any(isinstance(r, Exception) for r in results), results
    assert len(found) <= 1, "\n".join(found)  # the gradient norms' read-back, for all four
