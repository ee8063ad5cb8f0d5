"""A trained LoRA projection as one autograd node: same values and gradients as the plain ops,
fewer operations, and compute copies that follow every change of the fp32 masters."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tinsmith.models.lora import LoraLinear, together_groups, trained_together
from tinsmith.models.copy_refresh import refresh_copies
from tinsmith.models.lora_function import compute_copies, group_copies


class _Ops(TorchDispatchMode):
    """Counts dispatched operations by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _layer(dtype: torch.dtype, bias: bool = True, seed: int = 0) -> LoraLinear:
    torch.manual_seed(seed)
    lin = LoraLinear(64, 48, bias=bias)
    lin.weight.data = torch.randn(48, 64).to(dtype)
    if bias:
        lin.bias.data = torch.randn(48).to(dtype)
    w = lin.add_adapter(0, 8, 16.0, torch.Generator().manual_seed(1))
    with torch.no_grad():
        w.B.normal_()  # a trained adapter (B = 0 would hide half the gradients)
    return lin


def _reference(lin: LoraLinear, x: torch.Tensor, g: torch.Tensor):
    """Output and gradients by plain autograd in float64."""
    w = lin.adapters[0]
    x64 = x.detach().double().requires_grad_()
    A64, B64 = w.A.detach().double().requires_grad_(), w.B.detach().double().requires_grad_()
    bias = None if lin.bias is None else lin.bias.double()
    y = F.linear(x64, lin.weight.double(), bias) + w.scale * F.linear(F.linear(x64, A64), B64)
    y.backward(g.double())
    return y.detach(), x64.grad, A64.grad, B64.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_output_and_gradients_match_plain_autograd(dtype, tol, bias):
    lin = _layer(dtype, bias)
    w = lin.adapters[0]
    x = torch.randn(2, 10, 64, dtype=dtype, requires_grad=True)
    y = lin(x, [(0, 0, 20)])
    g = torch.randn_like(y)
    y.backward(g)
    ref = _reference(lin, x, g)
    for got, want in zip((y.detach(), x.grad, w.A.grad, w.B.grad), ref):
        assert got.shape == want.shape
        assert float((got.double() - want).abs().max() / want.abs().max()) < tol
    assert w.A.grad.dtype == w.B.grad.dtype == torch.float32  # the masters' gradients stay fp32


def test_a_frozen_input_gets_no_gradient_and_the_adapter_still_does():
    lin = _layer(torch.float32)
    x = torch.randn(6, 64)  # e.g. the embeddings feeding layer 0
    lin(x, [(0, 0, 6)]).square().sum().backward()
    assert lin.adapters[0].A.grad is not None and lin.adapters[0].B.grad is not None


def test_a_bf16_step_runs_five_products_and_no_cast_or_elementwise_op():
    lin = _layer(torch.bfloat16, bias=False)
    w = lin.adapters[0]
    refresh_copies([w], torch.bfloat16)
    x = torch.randn(12, 64, dtype=torch.bfloat16, requires_grad=True)
    with _Ops() as fwd:
        y = lin(x, [(0, 0, 12)])
    g = torch.randn_like(y)
    with _Ops() as bwd:
        y.backward(g)
    gemms = ("mm", "addmm", "addmm_")
    assert sum(fwd.ops[k] for k in gemms) == 3 and "_to_copy" not in fwd.ops, fwd.ops
    assert sum(bwd.ops[k] for k in gemms) == 5, bwd.ops
    assert not {"mul", "add", "add_"} & set(bwd.ops), bwd.ops  # scale and sums ride in the GEMMs
    assert bwd.ops["_to_copy"] <= 2  # the bf16 gradients cast to the fp32 masters


def test_compute_copies_follow_every_change_of_the_masters():
    lin = _layer(torch.bfloat16)
    w = lin.adapters[0]
    a1, b1 = compute_copies(w, torch.bfloat16)
    assert compute_copies(w, torch.bfloat16)[0] is a1  # kept while the masters are unchanged
    assert torch.equal(a1, w.A.detach().to(torch.bfloat16)) and torch.equal(b1, w.B.detach().to(torch.bfloat16))
    with torch.no_grad():
        w.A.add_(1.0)  # an optimizer step writes in place
    a2, _ = compute_copies(w, torch.bfloat16)
    assert a2 is not a1 and torch.equal(a2, w.A.detach().to(torch.bfloat16))
    with torch.no_grad():
        w.B.mul_(2.0)
    refresh_copies([w], torch.bfloat16)
    a3, b3 = w.copies[1], w.copies[2]
    assert torch.equal(b3, w.B.detach().to(torch.bfloat16)) and torch.equal(a3, a2)
    assert compute_copies(w, torch.bfloat16)[1] is b3  # the refreshed copies are the ones used
    # an adapter only sampled from (no kept copy) gets a cast that lasts one forward
    w.copies = None
    a4, _ = compute_copies(w, torch.bfloat16, keep=False)
    assert w.copies is None and torch.equal(a4, w.A.detach().to(torch.bfloat16))
    refresh_copies([w], torch.bfloat16)
    assert compute_copies(w, torch.bfloat16, keep=False)[0] is w.copies[1]  # a current kept copy is used
    # fp32 layers compute with the masters themselves and keep no copy
    w32 = _layer(torch.float32).adapters[0]
    assert compute_copies(w32, torch.float32)[0].data_ptr() == w32.A.data_ptr() and w32.copies is None


def _group(dtype: torch.dtype, seed: int = 0) -> tuple[LoraLinear, ...]:
    """q/k/v-like projections of one input (different widths, biases) with adapter 0 on each."""
    torch.manual_seed(seed)
    layers = (LoraLinear(64, 48, bias=True), LoraLinear(64, 16, bias=True), LoraLinear(64, 16))
    gen = torch.Generator().manual_seed(1)
    for layer in layers:
        layer.weight.data = torch.randn(layer.out_features, 64).to(dtype)
        if layer.bias is not None:
            layer.bias.data = torch.randn(layer.out_features).to(dtype)
        w = layer.add_adapter(0, 8, 16.0, gen)
        with torch.no_grad():
            w.B.normal_()
    return layers


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_projections_of_one_input_run_together_with_each_ones_values_and_gradients(dtype, tol):
    layers = _group(dtype)
    x = torch.randn(2, 10, 64, dtype=dtype, requires_grad=True)
    outs = trained_together(layers, x, [(0, 0, 20)])
    assert outs is not None and [o.shape for o in outs] == [(2, 10, 48), (2, 10, 16), (2, 10, 16)]
    gs = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, gs)
    x64 = x.detach().double().requires_grad_()
    total = 0
    for layer, o, g in zip(layers, outs, gs):
        w = layer.adapters[0]
        A64, B64 = w.A.detach().double().requires_grad_(), w.B.detach().double().requires_grad_()
        bias = None if layer.bias is None else layer.bias.double()
        y = F.linear(x64, layer.weight.double(), bias) + w.scale * F.linear(F.linear(x64, A64), B64)
        total = total + (y * g.double()).sum()
        assert float((o.detach().double() - y.detach()).abs().max() / y.detach().abs().max()) < tol
        dA, dB = torch.autograd.grad((y * g.double()).sum(), (A64, B64), retain_graph=True)
        for got, want in ((w.A.grad, dA), (w.B.grad, dB)):
            assert got.dtype == torch.float32 and float((got.double() - want).abs().max() / want.abs().max()) < tol
    total.backward()
    assert float((x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max()) < tol


def test_a_group_runs_its_products_and_no_cast_or_elementwise_op():
    layers = _group(torch.bfloat16)
    refresh_copies([], torch.bfloat16, [[layer.adapters[0] for layer in layers]])
    x = torch.randn(12, 64, dtype=torch.bfloat16, requires_grad=True)
    with _Ops() as fwd:
        outs = trained_together(layers, x, [(0, 0, 12)])
    with _Ops() as bwd:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    gemms = ("mm", "addmm", "addmm_")
    # forward: the stacked down-projection, then a base GEMM and an up-projection per part;
    # backward: per part its up-projection's input gradient, its share of dx and its B gradient,
    # then the adapter's part of dx and the stacked A gradient
    assert sum(fwd.ops[k] for k in gemms) == 7 and "_to_copy" not in fwd.ops, fwd.ops
    assert sum(bwd.ops[k] for k in gemms) == 11, bwd.ops
    assert not {"mul", "add", "add_"} & set(bwd.ops), bwd.ops
    assert bwd.ops["_to_copy"] <= 6


def test_a_group_falls_back_to_each_layer_when_its_adapters_differ():
    layers = _group(torch.float32)
    assert trained_together(layers, torch.randn(4, 64), [(1, 0, 4)]) is None  # no adapter 1 here
    layers[2].adapters[0].scale = 1.0
    assert trained_together(layers, torch.randn(4, 64), [(0, 0, 4)]) is None  # scales differ
    with torch.no_grad():
        assert trained_together(_group(torch.float32), torch.randn(4, 64), [(0, 0, 4)]) is None  # inference


def test_a_training_step_refreshes_the_copies_it_changed(qwen3_dir):
    from tinsmith.models.loading import load_model
    from tinsmith.types import AdamParams, LoraSpec
    from tinsmith.worker.trainables import attach_lora

    model = load_model(str(qwen3_dir), dtype=torch.bfloat16).model
    tr = attach_lora(model, 0, LoraSpec(rank=4, seed=3))
    alone = [w for layer, w in tr.attachments if isinstance(layer, LoraLinear)
             and not any(layer in g for g in together_groups(model))]
    groups = [[layer.adapters[0] for layer in g] for g in together_groups(model)]
    assert alone and groups  # o_proj and down_proj alone; q/k/v and gate/up in groups
    assert all(w.copies is not None for w in alone) and all(ws[0].group is not None for ws in groups)  # on attach
    for layer, w in tr.attachments:
        w.A.grad, w.B.grad = torch.ones_like(w.A), torch.ones_like(w.B)
    tr.step(AdamParams(learning_rate=1e-2))
    for w in alone:
        A_c, B_c = compute_copies(w, torch.bfloat16)
        assert A_c is w.copies[1]  # refreshed by the step itself, not at the next forward
        assert torch.equal(A_c, w.A.detach().to(torch.bfloat16)) and torch.equal(B_c, w.B.detach().to(torch.bfloat16))
    for ws in groups:
        cached = ws[0].group
        A_cat, Bs = group_copies(ws, torch.bfloat16)
        assert A_cat is cached[1]
        assert torch.equal(A_cat, torch.cat([w.A.detach() for w in ws]).to(torch.bfloat16))
        assert all(torch.equal(B_c, w.B.detach().to(torch.bfloat16)) for B_c, w in zip(Bs, ws))


def test_the_switch_runs_torchs_ops_with_the_same_values(monkeypatch):
    """bench/gpu times a step with ``FUSED_NODES`` off: that must be the plain ops, same result."""
    from tinsmith.models import lora_function

    results = {}
    for fused in (True, False):
        monkeypatch.setattr(lora_function, "FUSED_NODES", fused)
        layers = _group(torch.float32)
        x = torch.randn(12, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
        with _Ops() as ops:
            outs = (trained_together(layers, x, [(0, 0, 12)])
                    or tuple(layer(x, [(0, 0, 12)]) for layer in layers))
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        results[fused] = (ops.ops, [o.detach() for o in outs], x.grad, [l.adapters[0].A.grad for l in layers])
    assert "mul" in results[False][0] and "mul" not in results[True][0]
    for a, b in zip(results[True][1:], results[False][1:]):
        for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
