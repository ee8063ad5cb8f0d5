"""The RMSNorm kernel does the torch path's arithmetic (Hugging Face's order: fp32 norm, cast back,
scale in the input dtype) for plain hidden states and for q/k heads inside a packed projection."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tinsmith.kernels import rms_norm as rk
from tinsmith.models import layers


def assert_same_rounding(got: torch.Tensor, want: torch.Tensor, interpreted_atol: float = 2e-2) -> None:
    """Equal up to the last bit of a rare element (fp32 sums in another order), and within a bf16
    step. Triton's interpreter rounds fp32 to bf16 toward zero (a GPU rounds to nearest), so there
    bf16 results, rounded twice (the norm, then the scale), are held to two steps only (and to
    ``interpreted_atol`` where more roundings follow: the rotary's)."""
    if got.dtype == torch.bfloat16 and got.device.type == "cpu":  # rounded toward zero: a few steps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6 * 1.01, atol=interpreted_atol)
        return
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def torch_path(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dim() == 1:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 100, 2048])
def test_hidden_states(dtype, d):
    device = kernel_device()
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 5, d, generator=g) * 3).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    with torch.no_grad():
        got = rk.rms_norm(x, w, 1e-6)
    want = torch_path(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert_same_rounding(got, want)


def test_q_and_k_heads_of_a_packed_projection():
    """A strided view: q and k heads (each with its own weight) inside q|k|v columns of one output."""
    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    b, L, H, Hk, d = 2, 3, 4, 2, 32
    y = torch.randn(b * L, (H + 2 * Hk) * d, generator=g).to(device, torch.bfloat16)
    qk = y[:, : (H + Hk) * d].view(b, L, H + Hk, d)
    wq, wk = (1 + 0.1 * torch.randn(d, generator=g)).to(device, torch.bfloat16), \
        (1 + 0.1 * torch.randn(d, generator=g)).to(device, torch.bfloat16)
    w = torch.cat((wq.expand(H, d), wk.expand(Hk, d)))
    with torch.no_grad():
        got = rk.rms_norm(qk, w, 1e-6)
    assert_same_rounding(got, torch_path(qk, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_heads_normalised_and_turned_in_one_kernel(dtype):
    """The packed q/k heads' norm and then their rotary (layers.apply_rotary) in one kernel."""
    device = kernel_device()
    g = torch.Generator().manual_seed(1)
    b, L, H, Hk, d = 2, 5, 4, 2, 64
    y = (torch.randn(b * L, (H + 2 * Hk) * d, generator=g) * 2).to(device, dtype)
    qk = y[:, : (H + Hk) * d].view(b, L, H + Hk, d)
    w = (1 + 0.1 * torch.randn(H + Hk, d, generator=g)).to(device, dtype)
    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(device)
    positions = torch.arange(b * L, device=device).view(b, L) * 37
    cos, sin = rotary(positions, dtype)
    assert rk.rotary_usable(qk, cos, sin)
    with torch.no_grad():
        got = rk.rms_norm(qk, w, 1e-6, (cos, sin))
    want = layers.apply_rotary(torch_path(qk, w, 1e-6), cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_same_rounding(got, want, interpreted_atol=0.1)
    assert not rk.rotary_usable(qk, cos[..., : d // 2], sin[..., : d // 2])  # partial rotary: two steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 100, 2048])
def test_a_residual_add_and_the_norm_after_it(dtype, d):
    """``add_rms_norm``: the sum rounded as a ``dtype`` add rounds, and the norm of that rounded sum."""
    device = kernel_device()
    g = torch.Generator().manual_seed(d + 1)
    x = (torch.randn(2, 7, d, generator=g) * 3).to(device, dtype)
    delta = torch.randn(2, 7, d, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    with torch.no_grad():
        total, normed = rk.add_rms_norm(x, delta, w, 1e-6)
    want_total = x + delta
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
        torch.testing.assert_close(normed, torch_path(want_total, w, 1e-6), rtol=1e-5, atol=1e-6)
    else:
        assert_same_rounding(total, want_total)
        assert_same_rounding(normed, torch_path(total, w, 1e-6))  # the norm of the sum it wrote


def test_q_and_k_heads_each_with_their_own_weight_without_stacking_them():
    """``second``: the k heads (after the q heads) take the k norm's weight, the same result as
    one stacked (heads, d) weight, with and without the rotary."""
    device = kernel_device()
    g = torch.Generator().manual_seed(3)
    b, L, H, Hk, d = 2, 3, 4, 2, 64
    y = (torch.randn(b * L, (H + 2 * Hk) * d, generator=g) * 2).to(device, torch.float32)
    qk = y[:, : (H + Hk) * d].view(b, L, H + Hk, d)
    wq, wk = ((1 + 0.1 * torch.randn(d, generator=g)).to(device) for _ in range(2))
    stacked = torch.cat((wq.expand(H, d), wk.expand(Hk, d)))
    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(device)
    cos, sin = rotary(torch.arange(b * L, device=device).view(b, L) * 11, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(rk.rms_norm(qk, wq, 1e-6, second=(H, wk)), rk.rms_norm(qk, stacked, 1e-6),
                                   rtol=0, atol=0)
        torch.testing.assert_close(rk.rms_norm(qk, wq, 1e-6, (cos, sin), (H, wk)),
                                   rk.rms_norm(qk, stacked, 1e-6, (cos, sin)), rtol=0, atol=0)
        torch.testing.assert_close(layers.norm_and_rotary(qk, wq, 1e-6, cos, sin, (H, wk)),  # the torch path
                                   layers.apply_rotary(torch_path(qk, stacked, 1e-6), cos, sin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_alone_in_one_kernel(dtype, monkeypatch):
    """``turn``: a model without q/k norms (Llama) turns its packed q/k heads as apply_rotary's
    torch path does, in one kernel; ``store``: a decode step's keys (turned) and values land where
    the K/V store kernel puts them, the turned heads unchanged by it."""
    from tinsmith.kernels import kv_store

    device = kernel_device()
    g = torch.Generator().manual_seed(5)
    n, H, Hk, d, pages, page = 4, 4, 2, 64, 5, 16
    y = (torch.randn(n, (H + 2 * Hk) * d, generator=g) * 2).to(device, dtype)
    qk = y[:, : (H + Hk) * d].view(n, 1, H + Hk, d)
    v = y[:, (H + Hk) * d:].view(n, 1, Hk, d)
    rotary = layers.Rotary(d, layers.RopeConfig(theta=5e5)).to(device)
    cos, sin = rotary(torch.tensor([[7], [300], [2], [41]], device=device), dtype)
    monkeypatch.setattr(rk, "BACKEND", "triton")  # the kernel on this device, the interpreter's too
    assert not rk.turn_usable(qk, cos, sin)  # under autograd: the training kernels' (norm_grad) or torch's
    with torch.no_grad():
        assert rk.turn_usable(qk, cos, sin)
        assert not rk.turn_usable(qk, cos[..., : d // 2], sin[..., : d // 2])  # partial rotary: torch's
        got = rk.turn(qk, cos, sin)
        want = qk * cos + qk.roll(d // 2, -1) * sin  # apply_rotary's torch path
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert_same_rounding(got, want, interpreted_atol=0.1)
        K = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
        V = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
        at_page, at = torch.tensor([4, 0, 4, 2], device=device), torch.tensor([3, 15, 4, 0], device=device)
        want_K, want_V = K.clone(), V.clone()
        assert kv_store.store(want_K, want_V, got[:, 0, H:], v[:, 0], at_page, at)
        assert torch.equal(rk.turn(qk, cos, sin, H, store=(K, V, v, at_page, at)), got)
    assert torch.equal(K, want_K) and torch.equal(V, want_V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_keys_and_values_stored_by_the_norm_kernel(dtype):
    """``store``: the q/k heads come out as without it, and the k heads (as normalised and turned)
    and the row's values land in the pools exactly where the K/V store kernel puts them; nothing
    else in the pools moves."""
    from tinsmith.kernels import kv_store

    device = kernel_device()
    g = torch.Generator().manual_seed(4)
    n, H, Hk, d, pages, page = 5, 4, 2, 64, 7, 16
    y = (torch.randn(n, (H + 2 * Hk) * d, generator=g) * 2).to(device, dtype)
    qk = y[:, : (H + Hk) * d].view(n, 1, H + Hk, d)  # a decode step's packed q/k/v output
    v = y[:, (H + Hk) * d:].view(n, 1, Hk, d)
    wq, wk = ((1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype) for _ in range(2))
    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(device)
    cos, sin = rotary(torch.tensor([[3], [40], [17], [0], [9]], device=device), dtype)
    K = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
    V = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
    at_page = torch.tensor([3, 1, 6, 3, 0], device=device)  # rows 0 and 3 share a page
    at = torch.tensor([0, 15, 9, 1, 4], device=device)
    assert rk.store_usable(qk, v, K, V, H)
    want_K, want_V = K.clone(), V.clone()
    with torch.no_grad():
        want = rk.rms_norm(qk, wq, 1e-6, (cos, sin), (H, wk))
        assert kv_store.store(want_K, want_V, want[:, 0, H:], v[:, 0], at_page, at)
        got = rk.rms_norm(qk, wq, 1e-6, (cos, sin), (H, wk), store=(K, V, v, at_page, at))
    assert torch.equal(got, want)
    assert torch.equal(K, want_K) and torch.equal(V, want_V)
    assert not rk.store_usable(qk, v, K.float() if dtype != torch.float32 else K.half(), V, H)  # the pools' dtype
    assert not rk.store_usable(y[:, : (H + Hk) * d].view(1, n, H + Hk, d), v, K, V, H)  # one position a row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_of_the_gate_half_times_the_up_half(dtype, width):
    from tinsmith.kernels import swiglu

    device = kernel_device()
    g = torch.Generator().manual_seed(width)
    y = (torch.randn(5, 2 * width, generator=g) * 4).to(device, dtype)
    with torch.no_grad():
        got = swiglu.silu_mul(y)
    want = torch.nn.functional.silu(y[:, :width]) * y[:, width:]
    assert got.shape == (5, width) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert_same_rounding(got, want, interpreted_atol=0.1)


def test_layers_take_the_kernel_only_outside_autograd(monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(rk, "BACKEND", "triton")
    calls = []
    monkeypatch.setattr(rk, "rms_norm", lambda *a: calls.append(a) or None)  # None: the caller falls back
    x = torch.randn(4, 64, device=device)
    w = torch.ones(64, device=device)
    layers.rms_norm(x, w, 1e-6)  # grad mode: torch
    assert not calls
    with torch.no_grad():
        out = layers.rms_norm(x, w, 1e-6)
    assert len(calls) == 1  # asked, declined (None): the torch path answered
    torch.testing.assert_close(out, torch_path(x, w, 1e-6))


def test_residual_adds_take_the_kernel_for_plain_norms_outside_autograd(monkeypatch):
    """``layers.add_rms_norm`` asks the kernel outside autograd for a plain RMSNorm, and for one a
    tensor-parallel model wraps (``CopyToTP``: the identity outside autograd); never for Qwen3.5's
    offset norms or gpt-oss' fp32-scaled ones, nor under autograd."""
    from types import SimpleNamespace

    from tinsmith.parallel.layers import CopyToTP

    device = kernel_device()
    monkeypatch.setattr(rk, "BACKEND", "triton")
    calls = []
    monkeypatch.setattr(rk, "add_rms_norm", lambda *a: calls.append(a) or None)  # declined: torch answers
    h, delta = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    plain = layers.RMSNorm(64, 1e-6).to(device)
    for norm, asked in ((plain, True), (CopyToTP(plain, SimpleNamespace(size=2)), True),
                        (layers.RMSNorm(64, 1e-6, offset=True), False),
                        (layers.RMSNorm(64, 1e-6, scale_in_fp32=True), False)):
        calls.clear()
        with torch.no_grad():
            total, normed = layers.add_rms_norm(h, delta, norm.to(device))
        assert bool(calls) == asked, norm
        torch.testing.assert_close(total, h + delta)
        torch.testing.assert_close(normed, norm(h + delta))
    calls.clear()
    layers.add_rms_norm(h, delta, plain)  # autograd on: torch
    assert not calls


def test_dispatch_follows_backend(monkeypatch):
    x, w = torch.zeros(2, 4), torch.ones(4)
    with torch.no_grad():
        monkeypatch.setattr(rk, "BACKEND", "torch")
        assert not rk.usable(x, w)
        monkeypatch.setattr(rk, "BACKEND", "auto")
        assert rk.usable(x, w) == (rk.triton is not None and x.is_cuda)
        monkeypatch.setattr(rk, "BACKEND", "triton")
        assert rk.usable(x, w) == (rk.triton is not None)
        assert not rk.usable(x, torch.ones(3, 4))  # one weight row per head needs heads
        assert not rk.usable(torch.zeros(2, 8)[:, ::2], w)  # the vectors must be contiguous
        assert not rk.usable(x.bfloat16(), w)  # a weight of another dtype would promote the product


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import rms_norm as rk
from tinsmith.kernels import swiglu

target = GPUTarget("cuda", 90, 32)
fn = rk._rms_norm_kernel
for dt in sys.argv[1:]:
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "w2_ptr": f"*{dt}", "out_ptr": f"*{dt}", "res_ptr": f"*{dt}",
           "sum_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "heads": "i32", "split": "i32",
           "d": "i32", "eps": "fp32", "stride_row": "i64", "stride_head": "i64", "stride_w": "i64",
           "stride_rot": "i64", "K_ptr": f"*{dt}", "V_ptr": f"*{dt}", "v_ptr": f"*{dt}", "page_ptr": "*i64",
           "at_ptr": "*i64", "stride_vn": "i64", "stride_vh": "i64", "stride_page": "i64", "stride_kh": "i64",
           "stride_pos": "i64", "h_ptr": "*fp32", "b_ptr": f"*{dt}", "idx_ptr": "*i64", "hoff_ptr": "*i32",
           "stride_hn": "i64", "stride_bs": "i64", "stride_bo": "i64", "v_col": "i64"}
    pdl = dt == "bf16"  # bf16's with the dependent-launch wait (tinsmith.kernels.pdl)
    for block, rotary, residual, store, norm, lora in (
            (128, True, False, False, True, False), (128, True, False, True, True, False),
            (128, True, False, False, False, False), (128, True, False, True, False, False),
            (128, False, False, False, True, False), (2048, False, False, False, True, False),
            (2048, False, True, False, True, False), (128, True, False, True, True, True),
            (128, True, False, True, False, True), (2048, False, True, False, True, True)):
        sig_ = {name: sig.get(name, "constexpr") for name in fn.arg_names}
        const = {"BLOCK_D": block, "ROTARY": rotary, "RESIDUAL": residual, "STORE": store, "NORM": norm, "PDL": pdl,
                 "LORA": lora, "R": 32 if lora else 1, "BLOCK_R": 32 if lora else 1,
                 "LORA_CHUNK": min(block, rk.LORA_BLOCK) if lora else 1}
        assert triton.compile(ASTSource(fn=fn, signature=sig_, constexprs=const), target=target).asm["cubin"]
    sig = {"y_ptr": f"*{dt}", "out_ptr": f"*{dt}", "width": "i32", "stride_row": "i64", "h_ptr": "*fp32",
           "b_ptr": f"*{dt}", "idx_ptr": "*i64", "stride_hn": "i64", "stride_bs": "i64", "stride_bo": "i64",
           "a_ptr": f"*{dt}", "part_ptr": "*fp32", "hd_ptr": "*fp32", "ticket_ptr": "*i32", "stride_as": "i64",
           "stride_ar": "i64"}
    for block, lora, shrink in ((64, False, False), (1024, False, False), (128, True, False), (128, True, True),
                                (128, False, True)):
        sig_ = {name: sig.get(name, "constexpr") for name in swiglu._silu_mul_kernel.arg_names}
        const = {"BLOCK": block, "PDL": pdl, "LORA": lora, "R": 64 if lora else 1, "BLOCK_R": 64 if lora else 1,
                 "SHRINK": shrink, "R2": 32 if shrink else 1, "BLOCK_R2": 32 if shrink else 1,
                 "BLOCKS": 48 if shrink else 1}
        src = ASTSource(fn=swiglu._silu_mul_kernel, signature=sig_, constexprs=const)
        assert triton.compile(src, target=target).asm["cubin"]
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernels (and the SiLU-and-multiply one) for
    sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_sampler_through_the_kernel_samples_what_torch_samples(family, model_dirs, monkeypatch):
    """Every norm of a real model's prefill and decode (hidden states with the residual adds before
    them, and Qwen3's q/k heads inside the packed q/k/v output) and every MLP's SiLU and product
    through the kernels: the same tokens and logprobs as the torch path."""
    import numpy as np

    from tests.sampling.conftest import fresh_model, make_sampler, run, task

    device = kernel_device()
    if device != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 12 + 5 * i).tolist() for i in range(3)]
    results = {}
    from tinsmith.kernels import swiglu

    for backend in ("torch", "triton"):
        monkeypatch.setattr(rk, "BACKEND", backend)
        monkeypatch.setattr(swiglu, "BACKEND", backend)
        sampler = make_sampler(fresh_model(model_dirs[family]), model_dirs[family])
        results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=6, temperature=1.0, seed=i, stop=[])
                                         for i, p in enumerate(prompts)])
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)
