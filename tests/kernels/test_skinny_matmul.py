"""The skinny-product kernel computes ``x @ w (+ bias)`` as torch does: every split of the
reduction, row and column tiles cut at any size, weights of either layout, a bias; its split sums
repeat bit for bit and leave the tickets at zero; it serves only outside autograd and only a few
rows; and a sampler whose products take it samples what torch's products sample."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import guard as guard_mod
from tinsmith.kernels import skinny_matmul as sk
from tinsmith.kernels import tickets


@pytest.fixture
def gpu_blocks(monkeypatch):
    """Blocks as narrow as the shapes are on the interpreter's CPU tensors, so that small shapes
    take several blocks and splits as a GPU's large ones do."""
    monkeypatch.setattr(sk, "CPU_MAX_BLOCK", 32)


def _operands(m: int, k: int, n: int, device: str, dtype=torch.float32, w_layout: str = "in_out", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(k, n, generator=g) / k ** 0.5
    w = (w if w_layout == "in_out" else w.t().contiguous().t()).to(device, dtype)  # (out, in) transposed
    return x, w, (torch.randn(n, generator=g) / 4).to(device, dtype)


@pytest.mark.parametrize("m, k, n, split", [
    (1, 64, 48, None),        # one row, one block
    (5, 256, 100, 1),         # columns past a block, one split
    (64, 256, 96, 4),         # four splits of two blocks each
    (70, 200, 40, 3),         # two row tiles, the last split short of its blocks
    (3, 96, 33, 8),           # more splits asked than blocks: one a block
])
@pytest.mark.parametrize("w_layout", ["in_out", "out_in"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_gives_torchs_product(m, k, n, split, w_layout, with_bias, gpu_blocks):
    device = kernel_device()
    x, w, bias = _operands(m, k, n, device, w_layout=w_layout, seed=m + k + n)
    bias = bias if with_bias else None
    with torch.no_grad():
        got = sk.matmul_triton(x, w, bias, split)
    want = sk.matmul_torch(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not tickets.counters(x.device).any()  # every tile's last program set its count back


def test_rows_of_a_strided_input_and_bf16(gpu_blocks):
    """A view's row stride is honoured; bf16 operands multiply in fp32 and round once."""
    device = kernel_device()
    x, w, bias = _operands(12, 128, 64, device, seed=1)
    wide = torch.zeros(12, 300, device=device)
    wide[:, 7:135] = x
    with torch.no_grad():
        torch.testing.assert_close(sk.matmul_triton(wide[:, 7:135], w, bias, 2), sk.matmul_torch(x, w, bias),
                                   rtol=1e-5, atol=1e-5)
        xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
        got = sk.matmul_triton(xb, wb, bb, 2)
    want = (xb.float() @ wb.float() + bb.float()).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_split_sums_repeat_bit_for_bit(gpu_blocks):
    """The partials are added in split order whoever finished last: the same bits every call, and
    the same as adding the one-split products' partial sums by hand in that order."""
    device = kernel_device()
    x, w, _ = _operands(16, 256, 64, device, seed=2)
    with torch.no_grad():
        first = sk.matmul_triton(x, w, None, 4)
        assert sk.plan(16, 64, 256, cpu=device == "cpu", split=4)[3] == 4
        for _ in range(3):
            assert torch.equal(sk.matmul_triton(x, w, None, 4), first)
        by_hand = sum(sk.matmul_triton(x[:, s * 64:(s + 1) * 64], w[s * 64:(s + 1) * 64], None, 1) for s in range(4))
    torch.testing.assert_close(first, by_hand, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m, k, n, r", [(5, 256, 96, 24), (70, 128, 40, 8), (1, 64, 16, 16)])
def test_a_product_and_a_banks_shrink_in_one_launch(m, k, n, r, gpu_blocks, monkeypatch):
    """The shrink's programs after the product's: both outputs bit for bit what the two launches
    give (the shrink's own split and blocks, its partials in its order), rows of no adapter zeros."""
    from tinsmith.kernels import lora_gather as lg

    device = kernel_device()
    monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 32)  # the shrink splits too on these small inputs
    x, w, bias = _operands(m, k, n, device, seed=m + r)
    g = torch.Generator().manual_seed(r)
    A = (torch.randn(4, r, k, generator=g) / k ** 0.5).to(device)
    idx = torch.tensor([(i % 5) - 1 for i in range(m)], device=device)  # -1: the base model's rows
    with torch.no_grad():
        y, h = sk.matmul_shrinking_triton(x, w, bias, A, idx)
        assert torch.equal(y, sk.matmul_triton(x, w, bias))
        assert torch.equal(h, lg.shrink_triton(x, A, idx))
    if m > 1 and k > 32:
        assert lg.shrink_plan(m, k, r, True, None)[0] > 1  # the shrink's partials summed by its tickets
    torch.testing.assert_close(h, lg.shrink_torch(x, A, idx), rtol=1e-5, atol=1e-5)
    assert (h[idx < 0] == 0).all()
    assert not tickets.counters(x.device).any()


def test_the_fused_shrink_is_offered_only_where_both_kernels_run(monkeypatch):
    from tinsmith.kernels import lora_gather as lg

    x, w, _ = _operands(4, 32, 16, "cpu")
    A, idx = torch.randn(2, 8, 32), torch.tensor([0, 1, -1, 0])
    monkeypatch.setattr(sk, "BACKEND", "torch")
    with torch.no_grad():
        assert sk.matmul_shrinking(x, w, None, A, idx) is None
    if sk.triton is None:
        return
    monkeypatch.setattr(sk, "BACKEND", "triton")
    monkeypatch.setattr(lg, "BACKEND", "torch")
    with torch.no_grad():
        assert sk.matmul_shrinking(x, w, None, A, idx) is None  # the gathered kernels are off
        monkeypatch.setattr(lg, "BACKEND", "triton")
        assert sk.matmul_shrinking(x, w, None, A.double(), idx) is None
        y, h = sk.matmul_shrinking(x, w, None, A, idx)
    torch.testing.assert_close(y, x @ w)
    torch.testing.assert_close(h, lg.shrink_torch(x, A, idx))
    assert sk.matmul_shrinking(x, w, None, A, idx) is None  # gradients wanted


def test_the_plan_splits_for_programs_within_its_limits(monkeypatch):
    if not sk.triton_available():
        pytest.skip("triton is not installed")
    # 64 rows of the 1.7B shape's products: o (2048 -> 2048), down (6144 -> 2048), q/k/v (2048 -> 4096)
    for k, n in ((2048, 2048), (6144, 2048), (2048, 4096), (2048, 12288)):
        block_m, block_n, block_k, splits, k_split = sk.plan(64, n, k)
        assert (block_m, block_n, block_k) == (64, sk.BLOCK_N, sk.BLOCK_K)
        tiles = n // block_n
        assert 1 <= splits <= sk.MAX_SPLIT and k_split >= sk.MIN_K_SPLIT and k_split % block_k == 0
        assert splits * k_split >= k > (splits - 1) * k_split
        assert splits == 1 or tiles * (splits - 1) < sk.PROGRAMS  # no more splits than the programs ask
    assert sk.plan(64, 151936, 2048)[3] == 1  # the unembedding's columns fill the GPU alone
    assert sk.plan(4, 64, 100)[3] == 1  # too short to split
    assert sk.plan(256, 2048, 6144)[0] == 64  # more rows: several row tiles
    monkeypatch.setattr(tickets, "CAPACITY", 8)
    assert sk.plan(64, 2048, 6144)[3] == 1  # more tiles than counters: one split


def test_dispatch_serves_only_few_rows_outside_autograd(monkeypatch):
    x, w, bias = _operands(4, 32, 16, "cpu")
    calls = []
    monkeypatch.setattr(sk, "matmul_triton", lambda *a: calls.append(a) or sk.matmul_torch(*a[:3]))
    monkeypatch.setattr(sk, "BACKEND", "torch")
    with torch.no_grad():
        assert not sk.usable(x, w)
        sk.matmul(x, w)
    assert not calls
    monkeypatch.setattr(sk, "BACKEND", "auto")
    with torch.no_grad():
        assert sk.usable(x, w) == (sk.triton is not None and x.is_cuda)
    monkeypatch.setattr(sk, "BACKEND", "triton")
    if sk.triton is None:
        pytest.skip("triton is not installed")
    with torch.no_grad():
        assert sk.usable(x, w)
        torch.testing.assert_close(sk.matmul(x, w, bias), sk.matmul_torch(x, w, bias))
        torch.testing.assert_close(sk.linear(x.view(2, 2, 32), w.t(), bias), torch.nn.functional.linear(
            x.view(2, 2, 32), w.t(), bias))
        assert len(calls) == 2
        assert not sk.usable(torch.randn(sk.MAX_ROWS + 1, 32), w)  # a prefill's rows
        assert not sk.usable(x.double(), w.double())
        assert not sk.usable(x.bfloat16(), w)
    assert not sk.usable(x, w)  # gradients wanted: training's GEMMs and their backward
    y = sk.linear(x.requires_grad_(), w.t(), bias)
    y.sum().backward()
    assert x.grad is not None and len(calls) == 2


def test_a_failing_kernel_falls_back_to_torch_once(monkeypatch, caplog):
    if sk.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(sk, "BACKEND", "triton")
    monkeypatch.setattr(sk.GUARD, "failed", None)
    monkeypatch.setattr(guard_mod, "triton_interpreting", lambda: False)

    def broken(*a, **kw):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(sk, "matmul_triton", broken)
    x, w, _ = _operands(3, 16, 8, "cpu")
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        torch.testing.assert_close(sk.matmul(x, w), x @ w)
        assert sk.GUARD.failed and "no such instruction" in sk.GUARD.failed
        assert not sk.usable(x, w)
    assert "skinny matmul kernel cannot run here" in caplog.text


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
def test_a_sampler_through_the_kernel_samples_what_torch_samples(model_dirs, monkeypatch, static, gathered):
    """Prefill (too many rows: torch's) and decode (the kernel: every projection, the unembedding
    through its transposed tied weight) against torch's products, eager and static steps, with two
    adapters on some rows; with ``gathered`` the adapters' gathered kernels run in both samplers, so
    the kernel's sampler takes the banks' shrinks in its products' launches and torch's launches
    them apart. fp32: the tokens agree and the logprobs within rounding."""
    from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, task
    from tinsmith.kernels import lora_gather
    from tinsmith.models import lora
    from tinsmith.sampling.decode_graphs import DecodeGraphs

    if kernel_device() != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 20 + 9 * i).tolist() for i in range(3)]
    launches, fused = [], []
    real, real_fused = sk.matmul_triton, sk.matmul_shrinking_triton
    monkeypatch.setattr(sk, "matmul_triton", lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(sk, "matmul_shrinking_triton", lambda *a: fused.append(a[0].shape[0]) or real_fused(*a))
    monkeypatch.setattr(sk, "MAX_ROWS", 8)  # the prompts' prefill stays torch's
    monkeypatch.setattr(lora_gather, "BACKEND", "triton" if gathered else "torch")
    monkeypatch.setattr(lora, "DECODE_LORA", "bank" if gathered else "auto")  # banks in eager steps too
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(sk, "BACKEND", backend)
        model = fresh_model(model_dirs["qwen3"])
        random_adapter(model, 1, scale=0.5)
        random_adapter(model, 2, scale=0.5, seed=1)
        sampler = make_sampler(model, model_dirs["qwen3"])
        if static:
            sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
        results[backend] = run(sampler, [task(f"p{i}", p, slot=[None, 1, 2][i], max_tokens=10, temperature=1.0,
                                              seed=i, stop=[]) for i, p in enumerate(prompts)])
        if static:
            assert sampler.stats["static_steps"] > 0
    assert launches and max(launches) <= 8, "the kernel ran, for decode rows only"
    assert bool(fused) == gathered and max(fused, default=0) <= 8  # q/k/v, o, gate/up with their shrinks
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)


_COMPILE = BUILD_PRELUDE + '''
from tinsmith.kernels import skinny_matmul

sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
       "ticket_ptr": "*i32", "M": "i32", "N": "i32", "N_TILES": "i32", "stride_xm": "i64", "stride_xk": "i64",
       "stride_wk": "i64", "stride_wn": "i64", "stride_ym": "i64", "stride_yn": "i64", "stride_ps": "i64",
       "a_ptr": "*bf16", "idx_ptr": "*i64", "s_part_ptr": "*fp32", "h_ptr": "*fp32", "stride_as": "i64",
       "stride_ar": "i64", "stride_ak": "i64", "stride_sn": "i64", "stride_ss": "i64", "stride_sr": "i64",
       "stride_hn": "i64", "stride_hr": "i64"}
for k, k_split, splits, bias, pdl, shrink in ((2048, 512, 4, False, True, False), (6144, 768, 8, True, False, False),
                                              (2048, 2048, 1, False, True, False), (2048, 512, 4, False, True, True),
                                              (6144, 6144, 1, True, False, True)):
    build(skinny_matmul._skinny_kernel, sig, {"K": k, "K_SPLIT": k_split, "SPLITS": splits, "HAS_BIAS": bias,
                                               "WIDEN": False, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 64,
                                               "BLOCK_K": 128, "R": 96, "S_K_SPLIT": 512 if shrink else 1,
                                               "S_SPLITS": 4 if shrink else 1, "SHRINK": shrink,
                                               "R_BLOCKS": 2 if shrink else 1, "BLOCK_R": 64 if shrink else 16,
                                               "S_BLOCK_K": 128 if shrink else 16, "PDL": pdl})
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernel for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path)
