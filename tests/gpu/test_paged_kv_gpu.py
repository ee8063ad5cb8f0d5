"""The paged K/V cache on the GPU (the default there) samples what per-row buffers sample: fp32
token for token, bf16 up to the first token the two orders of summation round apart; and the
pages are all given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import run_to_end
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams

pytestmark = pytest.mark.gpu


def _sample(model, layout: str) -> tuple[dict, Sampler]:
    rng = np.random.default_rng(0)
    sampler = Sampler(model, lambda t: "", max_rows=6, kv_layout=layout, cuda_graphs=DEVICE == "cuda")
    tasks = [SampleTask(i, slot, SampleInput(rng.integers(4, 500, 5 + 37 * i), 1 + i % 2, SamplingParams(
        max_tokens=30 + 25 * (i % 3), temperature=0.9, seed=i, stop=[]))) for i, slot in enumerate([1, None, 2, 1, None, None, 2])]
    return run_to_end(sampler, tasks), sampler


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_sample_what_rows_sample(family, dtype, tmp_path):
    model = load_model(str(make_tiny_model(tmp_path / family, family, SMALL, seed=1)), device=DEVICE, dtype=dtype).model
    for slot, rank in ((1, 4), (2, 8)):
        random_adapter(model, slot, rank=rank, seed=slot)
    rows, _ = _sample(model, "rows")
    paged, sampler = _sample(model, "paged")
    assert not any(sampler.cache.owned)
    for key, ref in rows.items():
        for a, b in zip(ref.sequences, paged[key].sequences):
            n = len(a.tokens)
            if dtype == torch.float32:
                assert a.tokens.tolist() == b.tokens.tolist(), key
            else:
                same = [x == y for x, y in zip(a.tokens.tolist(), b.tokens.tolist())]
                n = same.index(False) if False in same else len(same)
            tol = 1e-3 if dtype == torch.float32 else 0.25
            assert np.abs(a.logprobs[:n] - b.logprobs[:n]).max(initial=0.0) < tol, key
