"""The skinny-product kernel on a GPU, where a tile's split programs really finish in any order:
at the 1.7B shape's decode products (bf16, the tied unembedding through its transpose), its
products are torch's within bf16 rounding, repeat bit for bit eagerly and replayed from a CUDA
graph (launched dependent on the kernel before where the device allows), and leave the tickets
at zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import assert_repeats_bit_for_bit, graphed, run_to_end
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams
from tinsmith.kernels import skinny_matmul as sk
from tinsmith.kernels import tickets
from tinsmith.kernels.guard import triton_interpreting

pytestmark = pytest.mark.gpu

# (rows, in, out, the weight as stored): q/k/v packed, o, gate/up packed, down, the unembedding
SHAPES = [(64, 2048, 4096, "in_out"), (64, 2048, 2048, "out_in"), (64, 2048, 12288, "in_out"),
          (64, 6144, 2048, "out_in"), (256, 6144, 2048, "out_in"), (8, 2048, 151936, "out_in"),
          (3, 2048, 4096, "in_out")]


@pytest.mark.parametrize("rows, k, n, layout", SHAPES)
def test_products_equal_torchs_and_repeat_under_replay(rows, k, n, layout):
    if torch.device(DEVICE).type != "cuda" or not sk.triton_available():
        pytest.skip("the kernel needs CUDA and triton")
    g = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.bfloat16)
    stored = (torch.randn(k, n, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    w = stored if layout == "in_out" else stored.t().contiguous().t()
    bias = (torch.randn(n, generator=g) / 4).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        want = (x.double() @ w.double() + bias.double())
        got = sk.matmul_triton(x, w, bias)
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-2 * want.abs().max().item(), err  # one bf16 rounding of an fp32 sum
        assert_repeats_bit_for_bit(lambda: sk.matmul_triton(x, w, bias), got, eager=50, captured=5, replays=5)


@pytest.mark.parametrize("rows, k, n, r", [(64, 2048, 4096, 96), (64, 2048, 2048, 32), (256, 2048, 12288, 64),
                                           (5, 2048, 4096, 96)])
def test_a_banks_shrink_in_the_products_launch_equals_its_own_launch(rows, k, n, r):
    """q/k/v, o and gate/up of the 1.7B shape with 8 adapters' banks (rank 32 a part): the product
    and the shrink in one launch give both launches' bits, eagerly and replayed, the tickets at zero."""
    if torch.device(DEVICE).type != "cuda" or not sk.triton_available():
        pytest.skip("the kernel needs CUDA and triton")
    from tinsmith.kernels import lora_gather as lg

    g = torch.Generator().manual_seed(rows + r)
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(k, n, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    A = (torch.randn(8, r, k, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16)
    idx = torch.tensor([(i % 9) - 1 for i in range(rows)], device=DEVICE)
    with torch.no_grad():
        want = sk.matmul_triton(x, w), lg.shrink_triton(x, A, idx)
        for _ in range(20):
            y, h = sk.matmul_shrinking_triton(x, w, None, A, idx)
            assert torch.equal(y, want[0]) and torch.equal(h, want[1])
        graph, [(y, h)] = graphed(lambda: sk.matmul_shrinking_triton(x, w, None, A, idx))
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want[0]) and torch.equal(h, want[1])
    assert not tickets.counters(x.device).any()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_sampler_through_the_kernel_samples_what_cublas_samples(graphs, tmp_path, monkeypatch):
    """A tiny Qwen3 in fp32 (``ieee`` products: only the sums' order differs from cuBLAS's), base
    rows and two adapters (their banks' shrinks taken in the products' launches), eagerly and
    replayed from CUDA graphs: the kernel's sampler samples the tokens of cuBLAS's, their logprobs
    within rounding. (In CPU mode, eagerly through Triton's
    interpreter.)"""
    cuda = torch.device(DEVICE).type == "cuda"
    if not sk.triton_available() or not (cuda or triton_interpreting()):
        pytest.skip("the kernel needs CUDA (or Triton's interpreter) and triton")
    if graphs and not cuda:
        pytest.skip("CUDA graphs exist only on CUDA devices")
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 500, 6 + 5 * i) for i in range(6)]
    calls = []
    real = sk.matmul_triton
    monkeypatch.setattr(sk, "matmul_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = {}
    for backend in ("torch", "auto" if cuda else "triton"):
        monkeypatch.setattr(sk, "BACKEND", backend)
        model = load_model(str(model_dir), device=DEVICE, dtype=torch.float32).model
        for slot in (1, 2):
            random_adapter(model, slot, rank=8, seed=slot)
        sampler = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=graphs)
        results[backend] = run_to_end(sampler, [
            SampleTask(i, [None, 1, 2][i % 3], SampleInput(p, 1, SamplingParams(
                max_tokens=24, temperature=[0.0, 1.0][i % 2], seed=i, stop=[]))) for i, p in enumerate(prompts)])
        if graphs:
            assert sampler.stats["graph_replays"] > 0, sampler.stats
    assert calls, "the kernel ran"
    for key, want in results["torch"].items():
        got = results["auto" if cuda else "triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)
