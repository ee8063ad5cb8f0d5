"""The sampler's prefix cache on the GPU: the suffix-over-cached-prefix attention (SDPA with a
boolean mask, sinks as an extra key) gives what a whole prefill gives, in fp32 and in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.prefix_cache import BLOCK
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams


def _run(sampler: Sampler, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for i, p in enumerate(prompts):
        sampler.add(SampleTask(i, None, SampleInput(np.asarray(p), 1, params)))
    out = {}
    while sampler.has_work():
        out.update(sampler.step(1.0))
    return out


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_hits_equal_whole_prefills(family, dtype, tmp_path):
    model_dir = make_tiny_model(tmp_path / family, family, SMALL, seed=1)
    model = load_model(str(model_dir), device=DEVICE, dtype=dtype).model
    rng = np.random.default_rng(0)
    system = rng.integers(4, SMALL.vocab_size, 4 * BLOCK + 3).tolist()
    prompts = [system + rng.integers(4, SMALL.vocab_size, 5 + 7 * i).tolist() for i in range(6)]
    want = _run(Sampler(model, lambda t: "", prefix_cache_bytes=0), prompts)
    cached = Sampler(model, lambda t: "")
    _run(cached, [system + [5]])
    got = _run(cached, prompts)
    assert all(r.prompt_cache_hit_tokens == 4 * BLOCK for r in got.values())
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: a different kernel's rounding
    for i in want:
        w, g = want[i].sequences[0], got[i].sequences[0]
        assert abs(float(g.logprobs[0]) - float(w.logprobs[0])) < tol, i
        if dtype == torch.float32:
            assert g.tokens.tolist() == w.tokens.tolist()
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=tol, rtol=0)
