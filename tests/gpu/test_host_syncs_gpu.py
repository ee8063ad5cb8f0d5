"""On the GPU itself: a decode burst and a training step wait for the device no more than the
CPU's audit says (tests/sampling/test_host_syncs.py, tests/worker/test_host_syncs.py).

CUDA's own account: ``torch.cuda.set_sync_debug_mode`` warns at every synchronising call (a read
of a device value, a blocking copy), naming the Python line. This is what checks, on a GPU, that
the non-blocking host-to-device copies of ``tinsmith.transfers`` do not wait. On the CPU
(``TINSMITH_GPU_TEST_DEVICE=cpu``) the same tests count with ``tinsmith.devtools.host_syncs``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.sampling.conftest import random_adapter
from tests.worker.helpers import sft_datum
from tinsmith.models import moe
from tinsmith.devtools.host_syncs import HostSyncs
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

pytestmark = pytest.mark.gpu
BURSTS = 3


@contextlib.contextmanager
def waits() -> Iterator[list[str]]:
    """The synchronising calls of the block, one entry each (where, what)."""
    found: list[str] = []
    if DEVICE != "cuda":
        with HostSyncs() as h:
            yield found
        found.extend(f"{e.where}: {e.kind} {e.what}" for e in h.events)
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                 if "called a synchronizing CUDA operation" in str(w.message))  # not the mode's own notice


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_decode_burst_waits_for_its_read_back_only(family, tmp_path, monkeypatch):
    if DEVICE != "cuda":  # the experts' path bf16 takes on a GPU (the CPU's loop over experts reads counts)
        monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    model = load_model(str(make_tiny_model(tmp_path / family, family, SMALL, seed=1)), device=DEVICE,
                       dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32).model
    for slot in (1, 2):
        random_adapter(model, slot, rank=8, seed=slot)
    sampler = Sampler(model, lambda t: "", cuda_graphs=DEVICE == "cuda", decode_burst=4)
    rng = np.random.default_rng(0)
    for i in range(6):
        sampler.add(SampleTask(i, [None, 1, 2][i % 3], SampleInput(rng.integers(4, 500, 30 + 9 * i), 1 + i % 2,
                                                                   SamplingParams(max_tokens=200, temperature=0.9,
                                                                                  seed=i, stop=[]))))
    with torch.inference_mode():
        sampler._admit([])
        for _ in range(2):  # the batch's tensors made, the graph of its bucket captured
            sampler._decode_step([])
        rows = len(sampler.rows)
        with waits() as found:
            for _ in range(BURSTS):
                sampler._decode_step([])
    assert len(sampler.rows) == rows
    assert len(found) <= 2 * BURSTS, "\n".join(found)  # each burst: its tokens and their logprobs


def test_a_training_step_waits_per_request_not_per_datum_or_layer(tmp_path):
    model = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), device=DEVICE,
                       dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32).model
    rt = TrainingRuntime(model, max_lora_adapters=4, max_lora_rank=16)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(4)]
    rng = np.random.default_rng(0)
    reqs = [TrainRequest(u, ForwardBackwardInput([sft_datum(rng, 30 + 7 * j, 500) for j in range(6)], "cross_entropy"))
            for u in units]
    rt.forward_backward(reqs)  # first-call costs (kernel selection, allocator) out of the way
    with waits() as found:
        results = rt.forward_backward(reqs)
    assert not any(isinstance(r, Exception) for r in results)
    # Per request its metrics and its outputs (the chunk bounds are found on the host).
    assert len(found) <= 2 * len(units), "\n".join(found)
