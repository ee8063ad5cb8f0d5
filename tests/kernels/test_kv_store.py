"""The K/V store kernel writes a decode step's keys and values where the torch writes put them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tinsmith.kernels import kv_store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_land_where_index_put_puts_them(dtype):
    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    pages, heads, page, d, n = 9, 2, 64, 48, 5
    K = torch.randn(pages, heads, page, d, generator=g).to(device, dtype)
    V = torch.randn(pages, heads, page, d, generator=g).to(device, dtype)
    # a step's k and v as the attention layer hands them over: strided views of wider outputs
    k = torch.randn(n, heads + 3, d, generator=g).to(device, dtype)[:, 1:1 + heads]
    v = torch.randn(n, 2 * heads, d, generator=g).to(device, dtype)[:, heads:]
    at_page = torch.tensor([3, 1, 8, 3, 5], device=device)
    at = torch.tensor([0, 63, 17, 1, 40], device=device)
    want_K, want_V = K.clone(), V.clone()
    want_K[at_page, :, at] = k
    want_V[at_page, :, at] = v
    assert kv_store.store(K, V, k, v, at_page, at)
    assert torch.equal(K, want_K) and torch.equal(V, want_V)


def test_dispatch_follows_backend(monkeypatch):
    k, K = torch.zeros(2, 1, 8), torch.zeros(3, 1, 64, 8)
    monkeypatch.setattr(kv_store, "BACKEND", "torch")
    assert not kv_store.usable(k, K)
    monkeypatch.setattr(kv_store, "BACKEND", "auto")
    assert kv_store.usable(k, K) == (kv_store.triton is not None and k.is_cuda)
    monkeypatch.setattr(kv_store, "BACKEND", "triton")
    assert kv_store.usable(k, K) == (kv_store.triton is not None)
    assert not kv_store.usable(k.double(), K)  # the pool's dtype only
    assert not kv_store.usable(torch.zeros(2, 1, 16)[:, :, ::2], K)  # unit stride along d


def test_a_paged_sampler_through_the_kernel_samples_what_torch_samples(model_dirs, monkeypatch):
    from tests.sampling.conftest import fresh_model, make_sampler, run, task

    if kernel_device() != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 30 + 25 * i).tolist() for i in range(3)]
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(kv_store, "BACKEND", backend)
        sampler = make_sampler(fresh_model(model_dirs["qwen3"]), model_dirs["qwen3"], kv_layout="paged")
        results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=40, temperature=1.0, seed=i, stop=[])
                                         for i, p in enumerate(prompts)])  # rows cross into new pages
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_norm_kernel_stores_a_decode_steps_keys_and_values_the_sampler_samples_the_same(family, model_dirs,
                                                                                            monkeypatch):
    """With the norm and K/V store kernels on, every decode step's attention layer has its keys and
    values written by the kernel that turns its q/k heads (Qwen3: with their norm; Llama: the
    rotary alone), no K/V store launch of its own, and the paged sampler samples what the torch
    path samples, rows crossing into new pages and padding rows included."""
    from tests.sampling.conftest import fresh_model, make_sampler, run, task
    from tinsmith.kernels import rms_norm as rk
    from tinsmith.sampling.paged_kv_cache import PagedKVCache

    if kernel_device() != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 30 + 25 * i).tolist() for i in range(3)]
    norm_stores, plain_writes = [], []
    kernel_name = "rms_norm" if family == "qwen3" else "turn"  # Llama has no q/k norms: the rotary alone
    norm, write = getattr(rk, kernel_name), PagedKVCache._write_step

    def counted_norm(*args, store=None, **kwargs):
        if store is not None:
            norm_stores.append(1)
        return norm(*args, store=store, **kwargs)

    def counted_write(self, layer, *args):
        if self.paged[layer]:
            plain_writes.append(layer)
        return write(self, layer, *args)

    monkeypatch.setattr(rk, kernel_name, counted_norm)
    monkeypatch.setattr(PagedKVCache, "_write_step", counted_write)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(kv_store, "BACKEND", backend)
        monkeypatch.setattr(rk, "BACKEND", backend)
        norm_stores.clear()
        plain_writes.clear()
        sampler = make_sampler(fresh_model(model_dirs[family]), model_dirs[family], kv_layout="paged")
        results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=40, temperature=1.0, seed=i, stop=[])
                                         for i, p in enumerate(prompts)])
    assert norm_stores and not plain_writes  # every paged decode write went through the norm's kernel
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import kv_store

target = GPUTarget("cuda", 90, 32)
fn = kv_store._store_kernel
for dt in sys.argv[1:]:
    types = {"K_ptr": f"*{dt}", "V_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "page_ptr": "*i64",
             "at_ptr": "*i64", "d": "i32", "stride_kn": "i64", "stride_kh": "i64", "stride_vn": "i64",
             "stride_vh": "i64", "stride_page": "i64", "stride_head": "i64", "stride_pos": "i64"}
    sig = {name: "constexpr" if name in ("BLOCK_D", "PDL") else types[name] for name in fn.arg_names}
    const = {"BLOCK_D": 128, "PDL": dt == "bf16"}  # bf16's with the dependent-launch wait (tinsmith.kernels.pdl)
    assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["cubin"]
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernel for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
