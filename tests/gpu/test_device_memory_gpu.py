"""``--device-memory-fraction`` on a real GPU: the allocator refuses beyond the cap, and what sizes
itself from the free memory (training micro-batches, the samplers' K/V budget, the health
reading) sees the share, not the device."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tinsmith import device_memory
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import _default_kv_bytes
from tinsmith.server.health import read_health
from tinsmith.worker.service import RuntimeOptions, auto_micro_batch_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="a memory cap needs CUDA's allocator")]

GIB = 1 << 30


def test_a_capped_server_sizes_itself_within_its_share(tmp_path):
    loaded = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), device="cuda",
                        dtype=torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = device_memory.free_and_total(device)
    assert device_memory.cap(device) is None and total == torch.cuda.get_device_properties(device).total_memory
    # Uncapped, the tiny model's micro-batches are as large as allowed (65,536 tokens: 5 KiB of
    # activations a token); capped at 1.25 GiB above what the allocator holds now, they are sized
    # from that (less the 1 GiB set aside for the logits' chunks): about 26k tokens.
    assert auto_micro_batch_tokens(loaded.config, loaded.model, RuntimeOptions()) == 65536
    fraction = (torch.cuda.memory_reserved(device) + 1.25 * GIB) / total
    device_memory.limit(device, fraction)
    try:
        free, capped_total = device_memory.free_and_total(device)
        assert capped_total == int(fraction * total) and free <= 1.25 * GIB + (1 << 20)
        assert _default_kv_bytes(device) <= 0.4 * free + 1
        assert 1024 <= auto_micro_batch_tokens(loaded.config, loaded.model, RuntimeOptions()) < 65536
        assert [d.limit_bytes for d in read_health().devices if d.index == device.index] == [capped_total]
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * GIB, dtype=torch.uint8, device=device)
        kept = torch.empty(GIB, dtype=torch.uint8, device=device)  # within the share
        del kept
    finally:
        device_memory.limit(device, 1.0)
    assert device_memory.cap(device) is None
    torch.empty(3 * GIB, dtype=torch.uint8, device=device)  # the whole device again
    assert device_memory.free_and_total(device)[1] == total and free0 > 0
