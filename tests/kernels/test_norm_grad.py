"""Training's RMSNorm, rotary and SiLU-and-multiply kernels give the torch path's outputs and
gradients (autograd through Hugging Face's order of operations), for hidden states, for q/k heads
normalised then turned, for frozen and trainable norm weights; their torch fall-backs for the
backward do too; and a model trains through them as through torch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import norm_grad, swiglu
from tinsmith.models import layers


@pytest.fixture(autouse=True)
def kernels_for_every_tensor(monkeypatch):
    """The kernels for CPU tensors too (Triton's interpreter), where tests do not choose."""
    monkeypatch.setattr(norm_grad, "BACKEND", "triton")
    monkeypatch.setattr(swiglu, "BACKEND", "triton")


def torch_norm(x, weight, eps):
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_rotary(x, cos, sin):
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def grads_of(fn, *inputs, grad_out):
    """``fn(*inputs)`` and the gradients of ``(out * grad_out).sum()`` for the inputs that need one."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def close(got, want, dtype, interpreted_bf16=(2 ** -6 * 1.01, 2e-2)):
    """fp32: to fp32's noise. bf16: within a bf16 step or two (Triton's interpreter rounds fp32 to
    bf16 toward zero where a GPU rounds to nearest, so rare elements differ by a step there)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    else:
        rtol, atol = interpreted_bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def rope(device, dtype, b, L, d):
    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(device)
    return rotary(torch.arange(b * L, device=device).view(b, L) * 37, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 100, 2048])
@pytest.mark.parametrize("train_weight", [False, True])
def test_norm_forward_and_backward(dtype, d, train_weight):
    device = kernel_device(runtime_loop_bounds=True)
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 7, d, generator=g) * 3).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype).requires_grad_(train_weight)
    grad = torch.randn(3, 7, d, generator=g).to(device, dtype)
    assert norm_grad.usable(x, w)
    got, got_grads = grads_of(lambda a, b: norm_grad.norm_rotary(a, b, 1e-6), x, w, grad_out=grad)
    want, want_grads = grads_of(lambda a, b: torch_norm(a, b, 1e-6), x, w, grad_out=grad)
    assert got.dtype == dtype and len(got_grads) == len(want_grads) == 1 + train_weight
    close(got, want, dtype)
    close(got_grads[0], want_grads[0], dtype)
    if train_weight:  # a sum over 21 vectors: bf16's rounding of each product shows more
        close(got_grads[1], want_grads[1], dtype, (2e-2, 5e-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_q_heads_normalised_then_turned(dtype, norm):
    """(b, L, heads, d) heads with the cos/sin of their position (broadcast over heads): the norm
    and the rotary after it (Qwen3), or the rotary alone (Llama, Qwen2)."""
    device = kernel_device(runtime_loop_bounds=True)
    g = torch.Generator().manual_seed(7)
    b, L, H, d = 2, 5, 3, 64
    x = (torch.randn(b, L, H, d, generator=g) * 2).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype).requires_grad_(norm)
    cos, sin = rope(device, dtype, b, L, d)
    grad = torch.randn(b, L, H, d, generator=g).to(device, dtype)
    weight = w if norm else None
    assert norm_grad.usable(x, weight, (cos, sin))

    def kernel(a, wt):
        return norm_grad.norm_rotary(a, wt if norm else None, 1e-6, (cos, sin))

    def reference(a, wt):
        return torch_rotary(torch_norm(a, wt, 1e-6) if norm else a, cos, sin)

    got, got_grads = grads_of(kernel, x, w, grad_out=grad)
    want, want_grads = grads_of(reference, x, w, grad_out=grad)
    bf16 = (2 ** -6 * 1.01, 0.1)  # more roundings in a row: the interpreter's shows more
    close(got, want, dtype, bf16)
    close(got_grads[0], want_grads[0], dtype, bf16)
    if norm:
        close(got_grads[1], want_grads[1], dtype, (3e-2, 0.15))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_heads_in_a_wider_row_normalised_then_turned(dtype, norm):
    """Several tenants' q/k/v come side by side, so the q (or k) heads of a token sit in a wider
    row: the kernels read them there (no copy), as from a contiguous tensor, and the gradient
    reaches only their columns of the row."""
    device = kernel_device(runtime_loop_bounds=True)
    g = torch.Generator().manual_seed(11)
    b, L, H, d, wide = 2, 5, 3, 64, 7 * 64  # the row: q (3 heads) then 4 more heads' worth of columns
    row = (torch.randn(b, L, wide, generator=g) * 2).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    cos, sin = rope(device, dtype, b, L, d)
    grad = torch.randn(b, L, H, d, generator=g).to(device, dtype)
    weight = w if norm else None
    q = row[..., d:d + H * d].view(b, L, H, d)  # columns past the row's start, as k's are
    assert not q.is_contiguous() and norm_grad.layout(q) == (H, wide)
    assert norm_grad.usable(q, weight, (cos, sin))
    got = norm_grad.norm_rotary(q, weight, 1e-6, (cos, sin))
    got.backward(grad)
    contiguous = q.detach().clone().requires_grad_()
    want = torch_rotary(torch_norm(contiguous, w, 1e-6) if norm else contiguous, cos, sin)
    want.backward(grad)
    bf16 = (2 ** -6 * 1.01, 0.1)
    close(got.detach(), want.detach(), dtype, bf16)
    close(row.grad[..., d:d + H * d].reshape(b, L, H, d), contiguous.grad, dtype, bf16)
    assert not row.grad[..., :d].any() and not row.grad[..., d + H * d:].any()


def test_vectors_the_kernels_cannot_address_take_torch():
    x = torch.randn(2, 5, 3, 64)
    assert norm_grad.layout(x) == (3, 192)
    assert norm_grad.layout(x.transpose(1, 2)) is None  # heads apart from each other along a token
    assert norm_grad.layout(x[..., ::2]) is None  # a vector's elements strided
    assert norm_grad.layout(torch.randn(5, 2, 3, 64).transpose(0, 1)) is None  # leading dimensions do not merge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_in_torch_is_the_kernels_backward(dtype):
    """Where the backward kernel cannot run, torch takes the gradient from the same saved tensors."""
    device = kernel_device()
    g = torch.Generator().manual_seed(3)
    b, L, H, d = 2, 3, 2, 32
    x = torch.randn(b, L, H, d, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype).requires_grad_()
    cos, sin = rope(device, dtype, b, L, d)
    grad = torch.randn(b, L, H, d, generator=g).to(device, dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6).reshape(-1)
    for rotary in (None, (cos, sin)):
        c, s = rotary if rotary else (None, None)

        def reference(a, wt):
            return torch_rotary(torch_norm(a, wt, 1e-6), cos, sin) if rotary else torch_norm(a, wt, 1e-6)

        want_x, want_w = grads_of(reference, x.requires_grad_(), w, grad_out=grad)[1]
        got_x, got_w = norm_grad.backward_in_torch(x.detach(), w.detach(), rstd, c, s, grad, True)
        close(got_x, want_x, dtype, (2 ** -6 * 1.01, 0.1))
        close(got_w, want_w, dtype, (3e-2, 0.15))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_forward_and_backward(dtype):
    device = kernel_device()
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(9, 300, generator=g) * 3).to(device, dtype).requires_grad_()
    up = torch.randn(9, 300, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(9, 300, generator=g).to(device, dtype)
    assert swiglu.grad_usable(gate, up)
    got, got_grads = grads_of(swiglu.silu_mul_grad, gate, up, grad_out=grad)
    want, want_grads = grads_of(lambda a, b: torch.nn.functional.silu(a) * b, gate, up, grad_out=grad)
    close(got, want, dtype)
    for a, b in zip(got_grads, want_grads):
        close(a, b, dtype)
    in_torch = swiglu.silu_mul_backward_in_torch(gate.detach(), up.detach(), grad)
    for a, b in zip(in_torch, want_grads):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_gate_and_up_side_by_side(dtype):
    """Several tenants' gate and up come side by side in one tensor: one kernel each way, the
    backward writing both halves' gradients into one tensor (nothing concatenates them)."""
    device = kernel_device()
    g = torch.Generator().manual_seed(6)
    y = (torch.randn(2, 9, 600, generator=g) * 3).to(device, dtype).requires_grad_()
    grad = torch.randn(2, 9, 300, generator=g).to(device, dtype)
    assert swiglu.packed_grad_usable(y)
    got, (got_grad,) = grads_of(swiglu.silu_mul_packed_grad, y, grad_out=grad)
    want, (want_grad,) = grads_of(lambda t: torch.nn.functional.silu(t[..., :300]) * t[..., 300:], y, grad_out=grad)
    close(got, want, dtype)
    close(got_grad, want_grad, dtype)
    assert not swiglu.packed_grad_usable(y[..., :598])  # not contiguous


def test_dispatch(monkeypatch):
    x, w = torch.zeros(2, 4, 3, 8, requires_grad=True), torch.ones(8)
    cos = sin = torch.ones(2, 4, 1, 8)
    monkeypatch.setattr(norm_grad, "BACKEND", "torch")
    assert not norm_grad.usable(x, w)
    monkeypatch.setattr(norm_grad, "BACKEND", "auto")
    assert norm_grad.usable(x, w) == (norm_grad.triton is not None and x.is_cuda)
    monkeypatch.setattr(norm_grad, "BACKEND", "triton")
    assert norm_grad.usable(x, w) == (norm_grad.triton is not None)
    if norm_grad.triton is None:
        return
    assert norm_grad.usable(x, None, (cos, sin)) and norm_grad.usable(x, w, (cos, sin))
    assert not norm_grad.usable(x, None)  # nothing to do
    assert not norm_grad.usable(x.transpose(1, 2), w)  # contiguous inputs only
    assert not norm_grad.usable(x, w.bfloat16())  # the product would promote
    assert not norm_grad.usable(x, w, (cos[..., :4], sin[..., :4]))  # partial rotary: torch
    with torch.no_grad():
        assert not norm_grad.usable(x, w)  # inference has its own kernels


def train_both_ways(model_dir, device: str, dtype: torch.dtype, monkeypatch) -> tuple[dict, dict, int]:
    """A training forward/backward of the model at ``model_dir`` (every weight trainable) through
    torch's norms, rotary and SiLU-and-multiply and through the kernels: backend -> (loss,
    gradients by name), the kernels' calls by (name, with a rotary), and the layer count."""
    from tinsmith.models.loading import load_model

    tokens = torch.randint(4, 400, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand(tokens.shape)
    results, calls = {}, []
    for module, name in ((norm_grad, "norm_rotary"), (swiglu, "silu_mul_grad")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: calls.append((name, len(a) > 3))
                            or real(*a))
    for backend in ("torch", "triton"):
        monkeypatch.setattr(norm_grad, "BACKEND", backend)
        monkeypatch.setattr(swiglu, "BACKEND", backend)
        model = load_model(str(model_dir), dtype=dtype).model.to(device)
        for p in model.parameters():
            p.requires_grad_(True)
        logits = model.logits(model.hidden_states(tokens, positions))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None})
    counted = {k: calls.count(k) for k in set(calls)}
    return results, counted, len(model.model.layers)


def assert_kernels_called(counted: dict, layers_: int) -> None:
    """Every norm (two a layer and the final one), every q and k rotary (with its norm on Qwen3,
    alone on Llama) and every MLP's SiLU-and-multiply went through the kernels."""
    assert counted == {("norm_rotary", True): 2 * layers_, ("norm_rotary", False): 2 * layers_ + 1,
                       ("silu_mul_grad", False): layers_}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_model_trains_through_the_kernels_as_through_torch(family, model_dirs, monkeypatch):
    """Every norm, rotary and SiLU-and-multiply of a real model's training forward and backward
    through the kernels (fp32): the same loss and the same full-weight gradients."""
    device = kernel_device(runtime_loop_bounds=True)
    if device != "cpu":
        pytest.skip("the GPU tier trains through the kernels on a GPU")
    results, counted, layers_ = train_both_ways(model_dirs[family], device, torch.float32, monkeypatch)
    assert_kernels_called(counted, layers_)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    want = results["torch"][1]
    assert set(results["triton"][1]) == set(want)
    assert any("norm" in n for n in want)
    for name, grad in results["triton"][1].items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_several_tenants_train_through_the_kernels_as_through_torch(family, model_dirs, monkeypatch):
    """Several tenants' q/k/v and gate/up come side by side (the grouped matmul forced, as on a
    GPU): the q and k heads go through the norm/rotary kernels where they sit in the wide row,
    gate and up through the side-by-side SiLU kernel; the same logprobs and every adapter's own
    gradients as through torch."""
    from tests.models.test_grouped_lora import _step, assert_same_step

    if kernel_device(runtime_loop_bounds=True) != "cpu":
        pytest.skip("the GPU tier trains through the kernels on a GPU")
    calls: list = []
    for module, name in ((norm_grad, "norm_rotary"), (swiglu, "silu_mul_packed_grad")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: calls.append((name, a[0].is_contiguous()))
                            or real(*a))
    steps = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(norm_grad, "BACKEND", backend)
        monkeypatch.setattr(swiglu, "BACKEND", backend)
        steps[backend] = _step(model_dirs[family], "grouped", monkeypatch)
    layers_ = 2
    assert calls.count(("silu_mul_packed_grad", True)) == layers_
    assert calls.count(("norm_rotary", False)) == 2 * layers_  # q and k, read in the row of all three
    assert_same_step(steps["triton"], steps["torch"])


_COMPILE = BUILD_PRELUDE + '''
from tinsmith.kernels import norm_grad, swiglu

for dt in sys.argv[1:]:
    common = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "rstd_ptr": "*fp32", "cos_ptr": f"*{dt}",
              "sin_ptr": f"*{dt}", "n": "i32", "heads": "i32", "d": "i32", "inner": "i32", "outer": "i32",
              "eps": "fp32", "g_ptr": f"*{dt}",
              "gx_ptr": f"*{dt}", "gw_ptr": "*fp32", "programs": "i32"}
    for block, rows, norm, rotary in ((128, 16, True, True), (128, 16, False, True), (2048, 1, True, False)):
        flags = {"BLOCK_D": block, "ROWS": rows, "NORM": norm, "ROTARY": rotary}
        build(norm_grad._forward_kernel, common, flags)
        for weight_grad in ((False, True) if norm else (False,)):
            build(norm_grad._backward_kernel, common, {**flags, "WEIGHT_GRAD": weight_grad})
    flat = {"g_ptr": f"*{dt}", "u_ptr": f"*{dt}", "out_ptr": f"*{dt}", "grad_ptr": f"*{dt}", "gg_ptr": f"*{dt}",
            "gu_ptr": f"*{dt}", "n": "i32"}
    build(swiglu._silu_mul_flat_kernel, flat, {"BLOCK": 1024})
    build(swiglu._silu_mul_backward_kernel, flat, {"BLOCK": 1024})
    packed = {"y_ptr": f"*{dt}", "grad_ptr": f"*{dt}", "gy_ptr": f"*{dt}", "width": "i32"}
    build(swiglu._silu_mul_packed_backward_kernel, packed, {"BLOCK": 1024})
'''

def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build the training kernels for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp32")
