"""The token-choice kernel on the GPU: a real vocabulary (151,936 entries) at 64 rows picks the
torch path's tokens with its logprobs, inside a captured graph too, and a sampler (CUDA graphs
on) samples through it what it samples through torch."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import assert_kernel_samples_as_torch
from tests.kernels.test_token_draw import test_the_kernel_hashes_the_uniforms_bit_for_bit as hashes_bit_for_bit
from tests.kernels.test_token_draw import torch_choice
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import lora_gather, token_draw
from tinsmith.models.loading import load_model
from tinsmith.sampling.logits import uniforms

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_here(monkeypatch):
    if torch.device(DEVICE).type == "cuda" and token_draw.triton is None:
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]')")
    if torch.device(DEVICE).type == "cpu" and not lora_gather.triton_interpreting():
        pytest.skip("on a CPU the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(token_draw, "BACKEND", "triton")


def _case(dtype: torch.dtype, rows: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE, dtype)
    temperature = torch.rand(rows, generator=g).to(DEVICE) * 1.5
    temperature[::5] = 0  # greedy rows among the sampled ones
    keys = torch.arange(rows, device=DEVICE)
    u = uniforms(keys * 104729, keys * 0, keys * 0 + 9)
    return logits, temperature, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_vocabulary_matches_the_torch_path(dtype):
    rows, vocab = (64, 151_936) if DEVICE == "cuda" else (3, 20_000)
    logits, temperature, u = _case(dtype, rows, vocab)
    tok, lp = token_draw.draw(logits, temperature, u)
    want_tok, want_lp = torch_choice(logits, temperature, u)
    assert (tok == want_tok).float().mean().item() >= (63 / 64 if DEVICE == "cuda" else 1.0)  # fp32 sums vs fp64
    same = tok == want_tok
    torch.testing.assert_close(lp[same], want_lp[same], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_the_kernel_replays_from_a_cuda_graph():
    logits, temperature, u = _case(torch.bfloat16, 16, 151_936)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        token_draw.draw(logits, temperature, u)  # builds the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, lp = token_draw.draw(logits, temperature, u)
    logits.copy_(logits.flip(-1))
    graph.replay()
    want_tok, want_lp = token_draw.draw(logits, temperature, u)
    assert tok.tolist() == want_tok.tolist()
    torch.testing.assert_close(lp, want_lp)


def test_the_sampler_samples_through_the_kernel_as_through_torch(tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)
    model = load_model(str(model_dir), device=DEVICE, dtype=torch.float32).model
    assert_kernel_samples_as_torch(model, token_draw, [9 + 40 * i for i in range(5)], 30, monkeypatch)


def test_the_compiled_kernel_hashes_the_uniforms_bit_for_bit():
    """The pick kernel's own splitmix64 (unsigned 64-bit constants, wrapping products) compiled
    for the GPU: ``keyed_uniforms``' float64 uniforms to the last bit."""
    hashes_bit_for_bit()
