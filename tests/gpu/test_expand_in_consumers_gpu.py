"""A decode step's LoRA expands taken by the kernels that read the projections' outputs, compiled on
a GPU: at a 1.7B layer's shapes (64 rows of 8 adapters and base rows, rank 32) the SiLU product,
the kernel turning the q/k heads and the residual add and norm give what the expand's own launch
and then the kernel give (within a step of bf16: the sums may be reduced in another order), the
SiLU product's shrink for the down projection what the gathered shrink gives, and a sampler
decoding rows of several adapters, its steps replayed from CUDA graphs, samples the same with the
expands and that shrink taken and left apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.kernels import test_expand_in_consumers as cpu_tests
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import rms_norm as rk
from tinsmith.kernels import swiglu

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def on_cuda():
    if torch.device(DEVICE).type != "cuda" or not lg.triton_available():
        pytest.skip("the kernels compile for CUDA only (the CPU's interpreter runs tests/kernels)")


def test_the_silu_product_takes_the_gate_up_expand_at_a_1_7b_layer():
    rows, width, rank = 64, 6144, 32
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(rows, 2 * width, generator=g) * 2).to(DEVICE, torch.bfloat16)
    h, B, h_offsets, idx = cpu_tests.bank(rows, [width, width], rank, torch.bfloat16, DEVICE, seed=1, slots=8)
    with torch.no_grad():
        assert swiglu.lora_usable(y, h, B)
        got = swiglu.silu_mul(y, (h, B, idx, h_offsets))
        expanded = y.clone()
        lg.expand_triton(expanded, h, B, idx, h_offsets)
        cpu_tests.same(got, swiglu.silu_mul(expanded))


def test_the_silu_product_takes_the_down_shrink_at_a_1_7b_layer():
    """Its blocks' partial sums finish in any order on a GPU; the row's last program adds them in
    block order: the same bits every call, and the gathered shrink's values within fp32
    reassociation."""
    from tinsmith.kernels import tickets

    rows, width, rank = 64, 6144, 32
    g = torch.Generator().manual_seed(6)
    y = (torch.randn(rows, 2 * width, generator=g) * 2).to(DEVICE, torch.bfloat16)
    h, B, h_offsets, idx = cpu_tests.bank(rows, [width, width], rank, torch.bfloat16, DEVICE, seed=7, slots=8)
    A = (torch.randn(8, rank, width, generator=g) / width**0.5).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        out, first = swiglu.silu_mul_shrinking(y, (h, B, idx, h_offsets), A, idx)
        for _ in range(20):
            assert torch.equal(swiglu.silu_mul_shrinking(y, (h, B, idx, h_offsets), A, idx)[1], first)
        torch.testing.assert_close(first, lg.shrink_triton(out, A, idx), rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    assert int(tickets.counters(torch.device(DEVICE))[:rows].abs().sum()) == 0


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_alone"])
def test_the_kernel_turning_q_and_k_takes_the_qkv_expand_at_a_1_7b_layer(norm):
    n, H, Hk, d, rank = 64, 16, 8, 128, 32
    g = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16
    y = (torch.randn(n, (H + 2 * Hk) * d, generator=g) * 2).to(DEVICE, dtype)
    h, B, h_offsets, idx = cpu_tests.bank(n, [H * d, Hk * d, Hk * d], rank, dtype, DEVICE, seed=3, slots=8)
    pages = n + 1
    K0 = torch.randn(pages, Hk, 16, d, generator=g).to(DEVICE, dtype)
    V0 = torch.randn(pages, Hk, 16, d, generator=g).to(DEVICE, dtype)
    page, at = torch.arange(n, device=DEVICE), torch.arange(n, device=DEVICE) % 16
    from tinsmith.models import layers

    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(DEVICE)
    cos, sin = rotary((torch.arange(n, device=DEVICE) * 7)[:, None], dtype)
    w = [(1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2)]

    def run(out, K, V, lora=None):
        qk, v = cpu_tests.views(out, H, Hk, d)
        store = (K, V, v, page, at)
        if norm:
            return rk.rms_norm(qk, w[0], 1e-6, (cos, sin), (H, w[1]), store=store, lora=lora)
        return rk.turn(qk, cos, sin, H, store=store, lora=lora)

    with torch.no_grad():
        K, V = K0.clone(), V0.clone()
        got = run(y, K, V, (h, B, idx, h_offsets))
        expanded = y.clone()
        lg.expand_triton(expanded, h, B, idx, h_offsets)
        want_K, want_V = K0.clone(), V0.clone()
        want = run(expanded, want_K, want_V)
    cpu_tests.same(got, want)
    cpu_tests.same(K, want_K)
    cpu_tests.same(V, want_V)


def test_the_residual_add_and_norm_takes_the_o_or_down_expand_at_a_1_7b_layer():
    rows, d, rank = 64, 2048, 32
    g = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16
    x = (torch.randn(rows, 1, d, generator=g) * 2).to(DEVICE, dtype)
    delta = torch.randn(rows, 1, d, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype)
    h, B, h_offsets, idx = cpu_tests.bank(rows, [d], rank, dtype, DEVICE, seed=5, slots=8)
    with torch.no_grad():
        total, out = rk.add_rms_norm(x, delta, w, 1e-6, (h, B, idx, h_offsets))
        expanded = delta.clone()
        lg.expand_triton(expanded.view(rows, d), h, B, idx)
        want_total, want_out = rk.add_rms_norm(x, expanded, w, 1e-6)
    cpu_tests.same(total, want_total)
    cpu_tests.same(out, want_out)


def test_a_graphed_sampler_of_several_adapters_samples_the_same_either_way(gpu_models, monkeypatch):
    """fp32 on the device, rows of three adapters and the base model in a paged cache, the decode
    steps captured and replayed: tokens equal, logprobs within 1e-3, with the expands taken by the
    kernels and with each its own launch."""
    from tests.gpu.helpers import run_to_end
    from tests.sampling.conftest import random_adapter
    from tinsmith.models import lora as lora_mod
    from tinsmith.models import lora_bank
    from tinsmith.models.loading import load_model
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    model = load_model(str(gpu_models[0]), device=torch.device(DEVICE), dtype=torch.float32).model
    for slot in (1, 2, 3):
        random_adapter(model, slot, rank=8, seed=slot)
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(lora_bank, "EXPANDS_TAKEN", frozenset({"heads", "silu", "norms"}) if fused else frozenset())
        monkeypatch.setattr(lora_bank, "SHRINKS_TAKEN", frozenset({"silu"}) if fused else frozenset())
        rng = np.random.default_rng(0)
        tasks = [SampleTask(i, (None, 1, 2, 3)[i % 4], SampleInput(rng.integers(4, 500, 20 + 3 * i), 1, SamplingParams(
            max_tokens=24, temperature=0.9, seed=i, stop=[]))) for i in range(8)]
        results[fused] = run_to_end(Sampler(model, lambda t: "", kv_layout="paged"), tasks)
    for key, res in results[False].items():
        for a, b in zip(res.sequences, results[True][key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            assert np.abs(a.logprobs - b.logprobs).max() < 1e-3, key
