"""The multi-adapter decode path on the GPU: the Triton kernels over the adapter banks sample what
the per-adapter path samples, in fp32 (dense and MoE) and within bf16 tolerance in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import run_to_end
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import lora_gather
from tinsmith.models import lora as lora_mod
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams

pytestmark = pytest.mark.gpu


def _sample(model, slots, mode, monkeypatch):
    monkeypatch.setattr(lora_mod, "DECODE_LORA", mode)
    rng = np.random.default_rng(0)
    return run_to_end(Sampler(model, lambda t: ""), [
        SampleTask(i, s, SampleInput(rng.integers(4, 500, 7 + i), 2,
                                     SamplingParams(max_tokens=12, temperature=0.8, seed=i, stop=[])))
        for i, s in enumerate(slots)])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bank_decode_equals_grouped_decode(family, dtype, tmp_path, monkeypatch):
    if torch.device(DEVICE).type == "cuda" and not lora_gather.triton_available():
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]')")
    model = load_model(str(make_tiny_model(tmp_path / family, family, SMALL, seed=1)), device=DEVICE, dtype=dtype).model
    for i, rank in enumerate((4, 8, 16)):
        random_adapter(model, 1_000_000 + i, rank=rank, seed=i)
    slots = [1_000_000, None, 1_000_001, 1_000_002, 1_000_000]
    ref = _sample(model, slots, "grouped", monkeypatch)
    got = _sample(model, slots, "bank", monkeypatch)
    for key in ref:
        for a, b in zip(ref[key].sequences, got[key].sequences):
            n = len(a.tokens)
            if dtype == torch.float32:
                assert a.tokens.tolist() == b.tokens.tolist(), key
            else:  # bf16 rounds differently on the two paths: compare up to the first differing token
                same = [x == y for x, y in zip(a.tokens.tolist(), b.tokens.tolist())]
                n = same.index(False) if False in same else len(same)
            tol = 1e-3 if dtype == torch.float32 else 0.25
            assert np.abs(a.logprobs[:n] - b.logprobs[:n]).max(initial=0.0) < tol, key
