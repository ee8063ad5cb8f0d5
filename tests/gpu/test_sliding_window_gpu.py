"""gpt-oss's sliding-window rings on the GPU: greedy decoding far past the ring (prefilled whole,
in chunks, and through the prefix cache) gives, in fp32, the tokens and logprobs the CPU gives,
which tests/sampling/test_sliding_window_cache.py checks against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams

pytestmark = pytest.mark.gpu

RING = 64  # the tiny gpt-oss's 16-token window, rounded up to a cache block


def _greedy(model, chunk: int | None) -> dict:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 500, n) for n in (150, 9, 2 * RING + 3)]
    sampler = Sampler(model, lambda t: "", max_rows=8, prefill_chunk_tokens=chunk, cuda_graphs=True)
    out = {}
    for round_ in range(2):  # the second round reads the first's prompts from the prefix cache
        for i, p in enumerate(prompts):
            sampler.add(SampleTask((round_, i), None, SampleInput(p, 1, SamplingParams(max_tokens=90, temperature=0.0,
                                                                                         stop=[]))))
        while sampler.has_work():
            for key, res in sampler.step(1.0):
                assert not isinstance(res, Exception), res
                out[key] = res.sequences[0]
    assert sampler.cache.K[0].shape[2] == RING
    return out


@pytest.mark.parametrize("chunk", [None, 40])
def test_rings_decode_on_the_gpu_as_on_the_cpu(tmp_path, chunk):
    model_dir = make_tiny_model(tmp_path / "gpt_oss", "gpt_oss", SMALL, seed=1)
    ref = _greedy(load_model(str(model_dir), "cpu", torch.float32).model, chunk)
    got = _greedy(load_model(str(model_dir), DEVICE, torch.float32).model, chunk)
    for key, seq in ref.items():
        assert got[key].tokens.tolist() == seq.tokens.tolist(), key
        np.testing.assert_allclose(got[key].logprobs, seq.logprobs, atol=1e-3, rtol=0)
