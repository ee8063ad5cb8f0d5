"""The health reading of CUDA devices (what /metrics and the dashboard show): every visible GPU
has its total memory; the one this process computes on has its used memory too (the others from
NVML where it is installed, without making a CUDA context of this process there)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tinsmith.server.health import read_health

pytestmark = pytest.mark.gpu


def test_every_visible_gpu_is_read():
    if DEVICE != "cuda":
        pytest.skip("reads CUDA devices")
    torch.ones(1, device="cuda:0")  # this process computes on GPU 0
    devices = read_health().devices
    assert len(devices) == torch.cuda.device_count()
    first = devices[0]
    assert first.total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert 0 < first.used_bytes <= first.total_bytes
    assert all(d.total_bytes and d.total_bytes > 0 for d in devices)
