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

target = GPUTarget("cuda", 90, 32)
fn = rk._rms_norm_kernel
for dt in sys.argv[1:]:
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}",
           "heads": "i32", "d": "i32", "eps": "fp32", "stride_row": "i64", "stride_head": "i64", "stride_w": "i64",
           "stride_rot": "i64", "BLOCK_D": "constexpr", "ROTARY": "constexpr"}
    for block, rotary in ((128, True), (128, False), (2048, False)):
        sig_ = {name: sig[name] for name in fn.arg_names}
        const = {"BLOCK_D": block, "ROTARY": rotary}
        assert triton.compile(ASTSource(fn=fn, signature=sig_, constexprs=const), target=target).asm["cubin"]
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernel for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_sampler_through_the_kernel_samples_what_torch_samples(family, model_dirs, monkeypatch):
    """Every norm of a real model's prefill and decode (hidden states, and Qwen3's q/k heads inside
    the packed q/k/v output) through the kernel: the same tokens and logprobs as the torch path."""
    import numpy as np

    from tests.sampling.conftest import fresh_model, make_sampler, run, task

    device = kernel_device()
    if device != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 12 + 5 * i).tolist() for i in range(3)]
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(rk, "BACKEND", backend)
        sampler = make_sampler(fresh_model(model_dirs[family]), model_dirs[family])
        results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=6, temperature=1.0, seed=i, stop=[])
                                         for i, p in enumerate(prompts)])
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)
