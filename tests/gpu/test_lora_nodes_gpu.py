"""The trained LoRA projections' autograd nodes on the device, in bf16: values and gradients
against float64, and, where the device's GEMMs write fp32 (``out_dtype``), the adapter's
gradients straight from them with no cast (the CPU version: tests/models/test_lora_function.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.gpu.conftest import DEVICE
from tests.models.test_lora_function import _group, _Ops
from tinsmith.models.lora import trained_together
from tinsmith.models.copy_refresh import refresh_copies
from tinsmith.models.lora_function import fp32_out_gemms

pytestmark = pytest.mark.gpu


def test_grouped_lora_nodes_on_the_device_match_float64():
    device = torch.device(DEVICE)
    layers = _group(torch.bfloat16)
    for layer in layers:
        layer.to(device)
        w = layer.adapters[0]
        layer.adapters[0] = type(w)(w.A.detach().to(device).requires_grad_(), w.B.detach().to(device).requires_grad_(),
                                    w.scale)
    refresh_copies([], torch.bfloat16, [[layer.adapters[0] for layer in layers]])
    x = torch.randn(256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    outs = trained_together(layers, x, [(0, 0, 256)])
    assert outs is not None
    gs = [torch.randn_like(o) for o in outs]
    fp32_out_gemms(x.device)  # its one-time check (a few casts of its own) before the backward is counted
    with _Ops() as bwd:
        torch.autograd.backward(outs, gs)
    x64 = x.detach().double()
    for layer, o, g in zip(layers, outs, gs):
        w = layer.adapters[0]
        A64, B64 = w.A.detach().double().requires_grad_(), w.B.detach().double().requires_grad_()
        bias = None if layer.bias is None else layer.bias.double()
        y = F.linear(x64, layer.weight.double(), bias) + w.scale * F.linear(F.linear(x64, A64), B64)
        dA, dB = torch.autograd.grad((y * g.double()).sum(), (A64, B64))
        assert float((o.detach().double() - y.detach()).abs().max() / y.detach().abs().max()) < 2e-2
        for got, want in ((w.A.grad, dA), (w.B.grad, dB)):
            assert got.dtype == torch.float32
            assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2
    if device.type != "cuda":
        return
    if not fp32_out_gemms(device):
        pytest.skip(f"torch {torch.__version__} has no fp32-out GEMM on this device: autograd casts the gradients")
    assert bwd.ops["_to_copy"] == 0, bwd.ops  # the adapter's gradients came out of the GEMMs in fp32


def _to_device(lin, device: torch.device) -> None:
    """The layer and its adapters' masters on ``device`` (the masters leaves that take gradients)."""
    lin.to(device)
    for slot in list(lin.adapters):
        w = lin.adapters[slot]
        lin.adapters[slot] = type(w)(w.A.detach().to(device).requires_grad_(), w.B.detach().to(device).requires_grad_(),
                                     w.scale)


def _assert_matches_float64(lin, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, segments: list) -> None:
    """``y`` (the layer's output for ``x``) and the adapters' gradients for the output gradient
    ``g`` within bf16 rounding of float64 autograd, segment by segment."""
    x64, g64 = x.detach().double(), g.double()
    want_y = F.linear(x64, lin.weight.double())
    for slot, a, b in segments:
        if slot is None:
            continue
        w = lin.adapters[slot]
        A64, B64 = w.A.detach().double().requires_grad_(), w.B.detach().double().requires_grad_()
        part = w.scale * F.linear(F.linear(x64[a:b], A64), B64)
        want_y[a:b] += part.detach()
        dA, dB = torch.autograd.grad((part * g64[a:b]).sum(), (A64, B64))
        for got, want in ((w.A.grad, dA), (w.B.grad, dB)):
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2
    assert float((y.detach().double() - want_y).abs().max() / want_y.abs().max()) < 2e-2


def test_several_tenants_node_on_the_device_matches_float64():
    """Four tenants' adapters (one of rank 16 padded to 32 in the stack, and rows of no adapter)
    on one bf16 projection, the way the device picks (grouped on Hopper), against float64."""
    from tinsmith.models.lora import LoraLinear

    device = torch.device(DEVICE)
    torch.manual_seed(0)
    lin = LoraLinear(256, 384, bias=False)
    lin.weight.data = torch.randn(384, 256).to(torch.bfloat16)
    for slot, rank in enumerate((32, 16, 32, 32)):
        w = lin.add_adapter(slot, rank, 32.0, torch.Generator().manual_seed(slot + 1))
        with torch.no_grad():
            w.B.normal_()
    _to_device(lin, device)
    sizes = (256, 64, 128, 256, 320)  # the second segment: no adapter
    slots = (0, None, 1, 2, 3)
    segments, start = [], 0
    for slot, n in zip(slots, sizes):
        segments.append((slot, start, start + n))
        start += n
    x = torch.randn(start, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x, segments)
    g = torch.randn_like(y)
    y.backward(g)
    _assert_matches_float64(lin, x, y, g, segments)


@pytest.mark.parametrize("packed", [False, True], ids=["own-weights", "packed-weights"])
def test_several_tenants_q_k_v_group_on_the_device_matches_float64(packed):
    """Three projections of one input (q/k/v widths of the 1.7B shape's heads, scaled down), two
    tenants and rows of none, as one grouped node on the device (one shrink and one expand over
    block-diagonal factors, the base GEMMs into column blocks of one output, or one GEMM over the
    packed weight), against float64."""
    from tinsmith.models.lora import LoraLinear, PackedProjection

    device = torch.device(DEVICE)
    torch.manual_seed(0)
    layers = []
    for out in (512, 256, 256):
        lin = LoraLinear(256, out, bias=False)
        lin.weight.data = torch.randn(out, 256).to(torch.bfloat16)
        for slot in (0, 1):
            w = lin.add_adapter(slot, 32, 32.0, torch.Generator().manual_seed(10 * slot + out))
            with torch.no_grad():
                w.B.normal_()
        _to_device(lin, device)
        layers.append(lin)
    pack = PackedProjection(layers) if packed else None
    segments = [(0, 0, 384), (None, 384, 448), (1, 448, 1024)]
    x = torch.randn(1024, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    outs = trained_together(tuple(layers), x, segments, pack)
    if device.type == "cuda":
        assert outs is not None  # grouped on the device: the group's node ran
    if outs is None:
        pytest.skip("the grouped matmul does not run here: each layer runs on its own")
    gs = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, gs)
    for layer, o, g in zip(layers, outs, gs):
        _assert_matches_float64(layer, x, o, g, segments)


def test_a_part_on_its_own_reads_its_block_of_the_groups_stacks_on_the_device():
    """After a several-tenant q/k/v group ran, its parts' B stacks are strided blocks of the
    group's block-diagonal stack; a part that then runs on its own (the group no longer fits)
    takes the grouped matmul on that strided block: its output and gradients against float64."""
    from tinsmith.models.lora import LoraLinear

    device = torch.device(DEVICE)
    torch.manual_seed(1)
    layers = []
    for out in (512, 256, 256):
        lin = LoraLinear(256, out, bias=False)
        lin.weight.data = torch.randn(out, 256).to(torch.bfloat16)
        for slot in (0, 1):
            w = lin.add_adapter(slot, 32, 32.0, torch.Generator().manual_seed(10 * slot + out))
            with torch.no_grad():
                w.B.normal_()
        _to_device(lin, device)
        layers.append(lin)
    segments = [(0, 0, 384), (None, 384, 448), (1, 448, 1024)]
    x = torch.randn(1024, 256, device=device, dtype=torch.bfloat16)
    if trained_together(tuple(layers), x.requires_grad_(), segments) is None:
        pytest.skip("the grouped matmul does not run here: each layer runs on its own")
    layers[2].remove_adapter(1)
    assert trained_together(tuple(layers), x, segments) is None
    assert not layers[0]._tenant_stack.B.is_contiguous()
    xg = x.detach().clone().requires_grad_()
    y = layers[0](xg, segments)
    g = torch.randn_like(y)
    y.backward(g)
    _assert_matches_float64(layers[0], xg, y, g, segments)
