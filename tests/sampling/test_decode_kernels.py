"""The sampler decoding through the decode kernels (Triton's interpreter on a CPU) samples what it
samples through torch: the attention kernels for every family's attention (grouped queries,
gpt-oss' sinks and a ring as long as its window, the gated attention of Qwen3.5 hybrids) and the
fused delta-rule step for the hybrids' Gated DeltaNet layers; rows of different lengths that
finish and move, seeded draws, and the fixed-shape step that CUDA graphs replay."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.conftest import SMALL
from tests.kernels.support import skip_if_interpreter_cannot_loop_to_runtime_bounds
from tests.sampling.conftest import make_sampler, run, task
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import decode_attention as da
from tinsmith.kernels import delta_rule as dr
from tinsmith.kernels import lora_gather as lg
from tinsmith.models.loading import load_model
from tinsmith.sampling.decode_graphs import DecodeGraphs


@pytest.fixture(scope="module")
def gpt_oss_ring_dir(tmp_path_factory):
    """gpt-oss whose window is one cache block, so its sliding layer's ring is exactly its window."""
    shape = dataclasses.replace(SMALL, sliding_window=64)
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss_ring") / "gpt_oss", "gpt_oss", shape, seed=4)


@pytest.fixture
def counted(monkeypatch):
    """Kernel launches of the test, counted; the backend set per call of ``sample``."""
    if not (da.triton_available() and lg.triton_interpreting()):
        pytest.skip("needs triton with TRITON_INTERPRET=1 set before it was imported")
    calls = {"n": 0, "delta": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def call(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    counting(da, "decode_attention", "n")
    counting(dr, "decode_step_", "delta")
    return calls


def sample(model, model_dir, backend, monkeypatch, static=False):
    monkeypatch.setattr(da, "BACKEND", backend)
    monkeypatch.setattr(dr, "BACKEND", backend)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 500, n).tolist() for n in (70, 5, 130, 33)]
    news = (40, 75, 12, 60)
    sampler = make_sampler(model, model_dir)
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    tasks = [task(i, p, max_tokens=n, temperature=0.0 if i % 2 else 1.0, seed=7 + i, stop=[])
             for i, (p, n) in enumerate(zip(prompts, news))]
    out = run(sampler, tasks)
    if static:
        assert sampler.stats["static_steps"] > 0
    return [out[i].sequences[0] for i in range(len(tasks))]


def _same(a, b):
    for x, y in zip(a, b):
        assert x.tokens.tolist() == y.tokens.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "gpt_oss_ring", "qwen3_5"])
def test_kernels_sample_what_sdpa_samples(family, counted, monkeypatch, request):
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    model_dir = request.getfixturevalue(f"{family}_dir")
    model = load_model(str(model_dir)).model
    reference = sample(model, model_dir, "torch", monkeypatch)
    assert counted["n"] == counted["delta"] == 0
    _same(sample(model, model_dir, "triton", monkeypatch), reference)
    assert counted["n"] > 0
    assert (counted["delta"] > 0) == (family == "qwen3_5")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_static_step_takes_the_kernels_too(family, counted, monkeypatch, request):
    """The fixed-shape step reads K/V at the cache's whole capacity through SDPA; the kernels stop
    at each row's own positions, padding rows included (a hybrid's padding rows keep their
    states through the fused step too), and sample the same."""
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    model_dir = request.getfixturevalue(f"{family}_dir")
    model = load_model(str(model_dir)).model
    reference = sample(model, model_dir, "torch", monkeypatch, static=True)
    _same(sample(model, model_dir, "triton", monkeypatch, static=True), reference)
    assert counted["n"] > 0


def test_sliding_layers_longer_rings_than_windows_keep_the_mask(gpt_oss_dir, counted, monkeypatch):
    """The tiny gpt-oss' 16-token window sits in a 64-slot ring: its sliding layer must not take
    the kernels (they would see the whole ring), its full layer must."""
    model = load_model(str(gpt_oss_dir)).model
    layers: list[int] = []
    real = da.try_decode_attention

    def which(q, K, *args, **kwargs):
        layers.append(next(i for i, t in enumerate(sampler.cache.K) if t is K))
        return real(q, K, *args, **kwargs)

    monkeypatch.setattr(da, "try_decode_attention", which)
    monkeypatch.setattr(da, "BACKEND", "triton")
    sampler = make_sampler(model, gpt_oss_dir)
    run(sampler, [task(0, list(range(4, 40)), max_tokens=5, temperature=0.0, stop=[])])
    assert layers and set(layers) == {1}
