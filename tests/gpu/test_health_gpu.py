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


def test_the_allocators_cuda_frees_are_counted():
    """``device_frees`` counts the caching allocator's cudaFree calls (each a wait for the whole
    device): giving a cached block back to the driver adds one."""
    if DEVICE != "cuda":
        pytest.skip("reads CUDA devices")
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    before = read_health().devices[0]
    assert before.allocator_retries is not None and before.allocator_retries >= 0
    del x
    torch.cuda.empty_cache()  # the cached 64 MB segment goes back to the driver
    after = read_health().devices[0]
    assert after.device_frees > before.device_frees
