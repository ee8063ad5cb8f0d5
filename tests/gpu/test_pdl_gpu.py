"""Programmatic dependent launch on the device (tinsmith.kernels.pdl): where the GPU has it, its
probe passes and a decode step replayed from CUDA graphs, every Triton kernel launched dependent on
the one before, samples bit for bit what the same graphs sample with every kernel launched as
before: the waits keep the stream's order (base rows and several adapters, greedy and seeded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import run_to_end
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import pdl
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams

pytestmark = pytest.mark.gpu


def _cuda() -> torch.device:
    device = torch.device(DEVICE)
    if device.type != "cuda":
        pytest.skip("dependent launches exist only on CUDA devices")
    return device


def test_probe_says_whether_the_device_has_dependent_launches():
    device = _cuda()
    x = torch.empty(1, device=device)
    if torch.cuda.get_device_capability(device) < (9, 0):
        assert not pdl.active(x) and "compute capability" in pdl.off_reason(device)
    else:
        assert pdl.active(x), pdl.off_reason(device)  # Hopper and newer, with a Triton that has the wait


def _tasks(slots):
    rng = np.random.default_rng(3)
    return [SampleTask(i, s, SampleInput(rng.integers(4, 500, 9 + 5 * i), 2,
                                         SamplingParams(max_tokens=48, seed=i, stop=[],
                                                        temperature=0.0 if i % 3 == 0 else 1.0)))
            for i, s in enumerate(slots)]


def test_graphed_decode_samples_the_same_with_and_without_dependent_launches(tmp_path, monkeypatch):
    device = _cuda()
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)
    got = {}
    for mode in ("auto", "off"):
        monkeypatch.setattr(pdl, "ENABLED", mode)
        model = load_model(str(model_dir), device=device, dtype=torch.bfloat16).model
        for slot, rank in ((1, 8), (2, 16)):
            random_adapter(model, slot, rank=rank, seed=slot)
        sampler = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=True)
        got[mode] = run_to_end(sampler, _tasks([None, 1, 2, None, 1, 2]))
        assert sampler.graphs.broken is None and sampler.stats["graph_replays"] > 0, sampler.stats
    for key, want in got["off"].items():
        for a, b in zip(got["auto"][key].sequences, want.sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            assert np.array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs)), key
