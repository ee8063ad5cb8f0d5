"""The decode attention kernels on the GPU: a real model's head layout (Qwen3-1.7B: 16 query heads
over 8 K/V heads of 128) and rows of very different lengths against an fp32 reference, the
kernels inside a captured CUDA graph (replayed after the rows' lengths moved), and the sampler
decoding through them as it decodes through SDPA."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import assert_kernel_samples_as_torch
from tests.kernels.test_decode_attention import reference
from tests.kernels.support import skip_if_interpreter_cannot_loop_to_runtime_bounds
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import decode_attention as da
from tinsmith.kernels import lora_gather, tickets
from tinsmith.models.loading import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernels_here():
    if torch.device(DEVICE).type == "cuda" and not da.triton_available():
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]')")
    if torch.device(DEVICE).type == "cpu" and not lora_gather.triton_interpreting():
        pytest.skip("on a CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
    skip_if_interpreter_cannot_loop_to_runtime_bounds()


def _case(dtype, rows=64, capacity=1024, hq=16, hk=8, d=128):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, hq, 1, d, generator=g).to(DEVICE, dtype)
    K, V = (torch.randn(rows + 3, hk, capacity, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    n_keys = torch.randint(1, capacity, (rows,), generator=g).to(DEVICE)
    n_keys[0], n_keys[1] = 1, capacity
    return q, K, V, n_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_head_layout_matches_the_reference(dtype):
    rows = 64 if DEVICE == "cuda" else 3
    q, K, V, n_keys = _case(dtype, rows=rows, capacity=1024 if DEVICE == "cuda" else 130)
    span = K.shape[2]
    got = da.decode_attention(q, K, V, n_keys, span)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference(q, K, V, n_keys, span), rtol=tol, atol=tol)
    sinks = torch.linspace(-2, 4, q.shape[1], device=DEVICE)
    got = da.decode_attention(q, K, V, n_keys, span, sinks=sinks)
    torch.testing.assert_close(got.float(), reference(q, K, V, n_keys, span, sinks), rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_the_kernels_replay_from_a_cuda_graph():
    """Captured once; the rows' key counts live on the device, so a replay after they change
    attends over the new counts with no recapture."""
    q, K, V, n_keys = _case(torch.bfloat16, rows=8, capacity=512)
    keys = n_keys.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        da.decode_attention(q, K, V, keys, 512)  # builds the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, K, V, keys, 512)
    for counts in (n_keys, torch.flip(n_keys, (0,)), torch.full_like(n_keys, 77)):
        keys.copy_(counts)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(q, K, V, counts, 512), rtol=2e-2, atol=2e-2)


def test_the_sampler_decodes_through_the_kernels_as_through_sdpa(tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)
    model = load_model(str(model_dir), device=DEVICE, dtype=torch.float32).model
    assert_kernel_samples_as_torch(model, da, [9 + 40 * i for i in range(5)], 30, monkeypatch)


@pytest.mark.skipif(DEVICE != "cuda", reason="the split programs race only on a GPU")
def test_the_last_split_combines_the_same_whatever_the_order():
    """Few rows over long keys (many splits a row): the splits combined by their last program
    equal the combine kernel's to rounding, and equal themselves bit for bit over 100 calls,
    eagerly and replayed from a graph; the counters are back at zero."""
    q, K, V, n_keys = _case(torch.bfloat16, rows=4, capacity=4096)
    splits, _ = da.split_plan(4, K.shape[1], 4096, 32, q.device)
    assert splits > 1
    first = da.decode_attention(q, K, V, n_keys, 4096)
    for _ in range(100):
        assert torch.equal(da.decode_attention(q, K, V, n_keys, 4096), first)
    assert not tickets.counters(q.device).any()
    da.COMBINE_IN_SPLITS = False
    try:
        kernel = da.decode_attention(q, K, V, n_keys, 4096)
    finally:
        da.COMBINE_IN_SPLITS = True
    torch.testing.assert_close(first.float(), kernel.float(), rtol=1e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = torch.stack([da.decode_attention(q, K, V, n_keys, 4096) for _ in range(10)])
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs, first.expand(10, *first.shape))


@pytest.mark.skipif(DEVICE != "cuda", reason="the paged cache's kernels run on CUDA (tests/kernels/test_kv_store.py "
                                             "checks the norm kernel's stores in Triton's interpreter)")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_keys_and_values_stored_by_the_norm_kernel_sample_as_torch_writes_them(family, tmp_path, monkeypatch):
    """Decode steps over paged K/V, their keys and values written by the kernel that turns the q/k
    heads (Qwen3: with their norm; Llama: the rotary alone) with the K/V store kernel on, sample
    what the torch writes sample (the store kernels off)."""
    from tinsmith.kernels import kv_store
    from tinsmith.kernels import rms_norm as rk

    model_dir = make_tiny_model(tmp_path / family, family, SMALL, seed=1)
    model = load_model(str(model_dir), device=DEVICE, dtype=torch.float32).model
    stores = []
    name = "rms_norm" if family == "qwen3" else "turn"
    kernel = getattr(rk, name)

    def counted(*args, store=None, **kwargs):
        stores.append(store is not None)
        return kernel(*args, store=store, **kwargs)

    monkeypatch.setattr(rk, name, counted)
    assert_kernel_samples_as_torch(model, kv_store, [9 + 40 * i for i in range(5)], 30, monkeypatch)
    assert any(stores)  # the kernel run stored through the norm
