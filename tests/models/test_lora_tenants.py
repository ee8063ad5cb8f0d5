"""Several tenants' LoRA on one projection in training as one autograd node (both ways it runs:
each tenant's GEMMs, and the grouped matmul): the values and gradients of float64 autograd, each
adapter's gradients from its own rows only, stacks that follow every change of the masters."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.models.test_lora_function import _Ops
from tinsmith.models import lora_function, moe
from tinsmith.models.lora import LoraLinear
from tinsmith.models.copy_refresh import refresh_stacks
from tinsmith.models.lora_tenants import TenantsLoraFunction

# (slot, rows): a rank-8 adapter, rows of no adapter, a rank-4 adapter (padded to 8 in the stack)
LAYOUT = [(0, 5), (None, 3), (1, 7)]


def _layer(dtype: torch.dtype, bias: bool = True) -> LoraLinear:
    torch.manual_seed(0)
    lin = LoraLinear(64, 48, bias=bias)
    lin.weight.data = torch.randn(48, 64).to(dtype)
    if bias:
        lin.bias.data = torch.randn(48).to(dtype)
    for slot, rank, alpha in ((0, 8, 16.0), (1, 4, 8.0)):
        w = lin.add_adapter(slot, rank, alpha, torch.Generator().manual_seed(slot + 1))
        with torch.no_grad():
            w.B.normal_()  # a trained adapter (B = 0 would hide half the gradients)
    return lin


def _segments(layout=LAYOUT) -> list:
    out, start = [], 0
    for slot, rows in layout:
        out.append((slot, start, start + rows))
        start += rows
    return out


def _reference(lin: LoraLinear, x: torch.Tensor, g: torch.Tensor, segments: list):
    """Output, input gradient and each adapter's gradients by plain autograd in float64."""
    x64 = x.detach().double().requires_grad_()
    masters = {s: (lin.adapters[s].A.detach().double().requires_grad_(),
                   lin.adapters[s].B.detach().double().requires_grad_()) for s in lin.adapters}
    bias = None if lin.bias is None else lin.bias.double()
    pieces = []
    for slot, a, b in segments:
        y = F.linear(x64[a:b], lin.weight.double(), bias)
        if slot is not None:
            A, B = masters[slot]
            y = y + lin.adapters[slot].scale * F.linear(F.linear(x64[a:b], A), B)
        pieces.append(y)
    y = torch.cat(pieces)
    y.backward(g.double())
    return y.detach(), x64.grad, {s: (A.grad, B.grad) for s, (A, B) in masters.items()}


@pytest.fixture(params=["loop", "grouped"])
def way(request, monkeypatch):
    """Each tenant's GEMMs (the CPU's default), or the grouped matmul (forced: the GPU's way)."""
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped" if request.param == "grouped" else "auto")
    return request.param


def _nodes(y: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind ``y``."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in seen:
            seen.add(type(fn).__name__)
            todo += [f for f, _ in fn.next_functions]
    return seen


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return float((got.double() - want).abs().max() / want.abs().max()) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_output_and_gradients_match_float64_autograd(way, dtype, tol, bias):
    lin = _layer(dtype, bias)
    segments = _segments()
    x = torch.randn(15, 64, dtype=dtype, requires_grad=True)
    with _Ops() as fwd:
        y = lin(x, segments)
    assert fwd.ops["_grouped_mm" if way == "grouped" else "addmm_"] == 2  # the node ran, the chosen way
    g = torch.randn_like(y)
    y.backward(g)
    y_ref, dx_ref, grads_ref = _reference(lin, x, g, segments)
    assert _close(y.detach(), y_ref, tol) and _close(x.grad, dx_ref, tol)
    for slot, (dA, dB) in grads_ref.items():
        w = lin.adapters[slot]
        assert w.A.grad.shape == w.A.shape and w.B.grad.shape == w.B.shape
        assert w.A.grad.dtype == w.B.grad.dtype == torch.float32  # the masters' gradients stay fp32
        assert _close(w.A.grad, dA, tol) and _close(w.B.grad, dB, tol)


def test_each_adapter_is_trained_by_its_own_rows_only(way):
    lin = _layer(torch.float32)
    x = torch.randn(15, 64, requires_grad=True)
    y = lin(x, _segments())
    g = torch.zeros_like(y)
    g[:5] = torch.randn(5, 48)  # a loss on adapter 0's rows alone
    y.backward(g)
    assert lin.adapters[0].A.grad.abs().sum() > 0 and lin.adapters[0].B.grad.abs().sum() > 0
    assert lin.adapters[1].A.grad.abs().sum() == 0 and lin.adapters[1].B.grad.abs().sum() == 0
    assert x.grad[5:].abs().sum() == 0


def test_a_frozen_adapter_gets_no_gradient_and_the_trained_one_does(way):
    lin = _layer(torch.float32)
    frozen = lin.adapters[1]
    frozen.A.requires_grad_(False)
    frozen.B.requires_grad_(False)
    x = torch.randn(15, 64)  # a frozen input too (the embeddings feeding layer 0)
    lin(x, _segments()).square().sum().backward()
    assert lin.adapters[0].A.grad is not None and lin.adapters[0].B.grad is not None
    assert frozen.A.grad is None and frozen.B.grad is None


def test_the_node_hands_the_masters_their_gradients_as_autograd_would(way):
    """The masters are not the node's inputs (autograd would deliver each leaf's gradient through
    a node of its own, several host microseconds a tensor): the node gives them their gradients
    itself, with what autograd's accumulation does: the gradient hooks, the master's layout, a
    sum over backwards, the post-accumulate hooks."""
    lin = _layer(torch.float32)
    x = torch.randn(15, 64, requires_grad=True)
    probe = lin(x, _segments())
    leaves = set()
    todo = [probe.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None:
            leaves |= {id(fn.variable)} if hasattr(fn, "variable") else set()
            todo += [f for f, _ in fn.next_functions]
    masters = [t for w in lin.adapters.values() for t in (w.A, w.B)]
    assert not leaves & {id(t) for t in masters}  # no edge to a master
    w0, w1 = lin.adapters[0], lin.adapters[1]
    w0.A.register_hook(lambda grad: 2 * grad)
    seen = []
    w1.B.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    y = lin(x, _segments())  # hooks are read when the gradients arrive, whichever way they do
    g = torch.randn_like(y)
    y.backward(g)
    _, _, ref = _reference(lin, x, g, _segments())
    assert _close(w0.A.grad, 2 * ref[0][0], 1e-5) and _close(w0.B.grad, ref[0][1], 1e-5)
    assert len(seen) == 1 and torch.equal(seen[0], w1.B.grad)
    # Adapter 1's rank (4) is padded to 8 in the grouped stacks: its B gradient, a block of a
    # wider tensor, comes in the master's own layout.
    assert w1.B.grad.stride() == w1.B.stride() and w1.A.grad.stride() == w1.A.stride()
    first = {id(t): t.grad.clone() for t in masters}
    lin(x, _segments()).backward(g)  # a second backward adds to the gradients there
    for t in masters:
        assert _close(t.grad, 2 * first[id(t)].double(), 1e-6)
    assert len(seen) == 2


def test_the_stack_follows_an_optimizer_step_and_is_kept_while_nothing_changes(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    lin = _layer(torch.bfloat16, bias=False)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    with torch.enable_grad():
        lin(x, _segments())
    stack = lin._tenant_stack
    lin(x, _segments()).sum().backward()
    assert lin._tenant_stack is stack  # the same masters: the same stack
    with torch.no_grad():
        lin.adapters[1].B.add_(1.0)  # an optimizer step of one tenant
    y = lin(x, _segments())
    assert lin._tenant_stack is not stack
    y_ref, _, _ = _reference(lin, x, torch.zeros(15, 48, dtype=torch.bfloat16), _segments())
    assert _close(y.detach(), y_ref, 2e-2)
    lin.remove_adapter(1)
    assert lin._tenant_stack is None  # a removed adapter leaves no copy on the device


def test_without_fused_nodes_the_plain_ops_run(monkeypatch):
    monkeypatch.setattr(lora_function, "FUSED_NODES", False)
    lin = _layer(torch.float32)
    y = lin(torch.randn(15, 64, requires_grad=True), _segments())
    assert y.grad_fn is not None and "TenantsLoraFunctionBackward" not in _nodes(y)


def test_inference_does_not_take_the_node():
    lin = _layer(torch.float32)
    x = torch.randn(15, 64, requires_grad=True)
    with torch.no_grad():
        assert lin(x, _segments()).grad_fn is None
    y = lin(x, _segments())
    assert TenantsLoraFunction.__name__ + "Backward" in _nodes(y)


def test_an_optimizer_step_refreshes_the_stack_in_place(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    lin = _layer(torch.bfloat16, bias=False)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    lin(x, _segments()).sum().backward()
    A, B = lin._tenant_stack.A, lin._tenant_stack.B
    w = lin.adapters[1]
    with torch.no_grad():
        w.A.mul_(2.0)  # a step of adapter 1 (rank 4: its rows of the rank-8 stack are padded)
        w.B.add_(1.0)
    refresh_stacks([(lin, w)])
    assert lin._tenant_stack.A is A and lin._tenant_stack.B is B  # written in place, kept
    torch.testing.assert_close(A[2, :4], w.A.detach().to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(B[2, :, :4], (w.B.detach().to(torch.bfloat16) * w.scale), rtol=0, atol=0)
    assert A[2, 4:].abs().sum() == 0 and B[2, :, 4:].abs().sum() == 0  # the padding stays zero
    y = lin(x, _segments())
    assert lin._tenant_stack.A is A  # the key follows: no rebuild at the next forward
    y_ref, _, _ = _reference(lin, x, torch.zeros(15, 48, dtype=torch.bfloat16), _segments())
    assert _close(y.detach(), y_ref, 2e-2)


def test_a_training_runs_steps_keep_every_layers_stack_current(qwen3_dir, monkeypatch):
    """Two tenants trained together (grouped, forced): after each step's optimizer steps every
    layer's stack is the same buffer, matching the adapters' new weights, so the next forward
    rebuilds none."""
    from bench.gpu.train import batch, training_step
    from tinsmith.models.loading import load_model
    from tinsmith.types import LoraSpec
    from tinsmith.worker.runtime import TrainingRuntime

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    model = load_model(str(qwen3_dir), dtype=torch.bfloat16).model
    rt = TrainingRuntime(model, max_lora_adapters=4, max_lora_rank=8)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(2)]
    work = {u: batch(model.config.vocab_size, 2, 16, seed=i) for i, u in enumerate(units)}
    training_step(rt, work)()
    layers = [m for m in model.modules() if isinstance(m, LoraLinear) and m._tenant_stack is not None]
    assert layers
    buffers = {id(layer): layer._tenant_stack.A for layer in layers}
    training_step(rt, work)()
    for layer in layers:
        stack = layer._tenant_stack
        A, weights = stack.A, stack.weights
        assert A is buffers[id(layer)]
        assert stack.current(weights, A.shape[1], A.dtype)
        for i, w in enumerate(weights):
            torch.testing.assert_close(A[i], w.A.detach().to(A.dtype), rtol=0, atol=0)


def _group_layers(dtype: torch.dtype) -> tuple[LoraLinear, ...]:
    """q/k/v-like: three projections of one 64-wide input, 48/16/16 wide, each with adapters 0
    (rank 8) and 1 (rank 4)."""
    torch.manual_seed(0)
    layers = []
    for out in (48, 16, 16):
        lin = LoraLinear(64, out, bias=out == 48)
        lin.weight.data = torch.randn(out, 64).to(dtype)
        if lin.bias is not None:
            lin.bias.data = torch.randn(out).to(dtype)
        for slot, rank, alpha in ((0, 8, 16.0), (1, 4, 8.0)):
            w = lin.add_adapter(slot, rank, alpha, torch.Generator().manual_seed(10 * slot + out))
            with torch.no_grad():
                w.B.normal_()
        layers.append(lin)
    return tuple(layers)


@pytest.mark.parametrize("packed", [False, True], ids=["own-weights", "packed-weights"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_group_of_projections_of_several_tenants_is_one_node(dtype, tol, packed, monkeypatch):
    from tinsmith.models.lora import PackedProjection, trained_together

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layers = _group_layers(dtype)
    pack = PackedProjection(list(layers)) if packed else None  # the layers' weights become its columns
    segments = _segments()
    x = torch.randn(15, 64, dtype=dtype, requires_grad=True)
    with _Ops() as fwd:
        outs = trained_together(layers, x, segments, pack)
    assert outs is not None and "TenantsGroupFunctionBackward" in _nodes(outs[0])
    # One shrink and one expand for every part; the base one GEMM over the packed weight, else one per part.
    assert fwd.ops["_grouped_mm"] == 2
    assert fwd.ops["addmm_"] == (1 if packed else len(layers))
    gs = [torch.randn_like(o) for o in outs]
    with _Ops() as bwd:
        torch.autograd.backward(outs, gs)
    # The parts' shrink gradients, the input's adapter part, every dA and every dB: one grouped product each.
    assert bwd.ops["_grouped_mm"] == 4
    assert bwd.ops["addmm_"] == (1 if packed else len(layers))
    x_ref = x.detach().clone().requires_grad_()
    dx_ref = torch.zeros(15, 64, dtype=torch.float64)
    for layer, o, g in zip(layers, outs, gs):
        y_ref, dx, grads = _reference(layer, x_ref, g, segments)
        dx_ref += dx
        assert _close(o.detach(), y_ref, tol)
        for slot, (dA, dB) in grads.items():
            w = layer.adapters[slot]
            assert w.A.grad.dtype == w.B.grad.dtype == torch.float32
            assert _close(w.A.grad, dA, tol) and _close(w.B.grad, dB, tol), (layer.out_features, slot)
    assert _close(x.grad, dx_ref, tol)


def test_the_group_follows_a_refreshed_stack_and_falls_back_when_tenants_differ(monkeypatch):
    from tinsmith.models.lora import trained_together

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layers = _group_layers(torch.bfloat16)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    trained_together(layers, x, _segments())
    w = layers[1].adapters[1]
    with torch.no_grad():
        w.A.mul_(3.0)
    refresh_stacks([(layers[1], w)])  # an optimizer step of adapter 1 on the k-like part
    outs = trained_together(layers, x, _segments())
    y_ref, _, _ = _reference(layers[1], x, torch.zeros(15, 16, dtype=torch.bfloat16), _segments())
    assert _close(outs[1].detach(), y_ref, 2e-2)
    layers[2].remove_adapter(1)  # adapter 1 no longer on every part: each layer on its own
    assert trained_together(layers, x, _segments()) is None


def test_a_part_running_on_its_own_after_its_group_reads_its_block_of_the_groups_stacks(monkeypatch):
    """A group's parts keep their stacks as views of the group's buffers (B: a diagonal block of
    the block-diagonal stack). When the group cannot run (an adapter left one part), the other
    parts run on their own from those views: still each part's own output and gradients."""
    from tinsmith.models.lora import trained_together

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layers = _group_layers(torch.float32)
    segments = _segments()
    x = torch.randn(15, 64)
    trained_together(layers, x, segments)
    view = layers[0]._tenant_stack.B
    assert view.data_ptr() == layers[0]._tenant_cat[1].data_ptr() and not view.is_contiguous()
    layers[2].remove_adapter(1)
    assert trained_together(layers, x, segments) is None
    xg = x.clone().requires_grad_()
    y = layers[0](xg, segments)
    assert layers[0]._tenant_stack.B is view  # the group's block, not a new stack
    g = torch.randn_like(y)
    y.backward(g)
    y_ref, dx_ref, grads = _reference(layers[0], x, g, segments)
    assert _close(y.detach(), y_ref, 1e-5) and _close(xg.grad, dx_ref, 1e-5)
    for slot, (dA, dB) in grads.items():
        w = layers[0].adapters[slot]
        assert _close(w.A.grad, dA, 1e-5) and _close(w.B.grad, dB, 1e-5)


def test_a_refresh_reaches_every_segment_an_adapter_holds(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    lin = _layer(torch.float32)
    segments = _segments([(0, 5), (1, 3), (0, 7)])  # adapter 0 in two segments
    x = torch.randn(15, 64)
    lin(x, segments).sum().backward()
    w = lin.adapters[0]
    with torch.no_grad():
        w.B.add_(1.0)
    refresh_stacks([(lin, w)])
    B = lin._tenant_stack.B
    for i in (0, 2):
        torch.testing.assert_close(B[i], w.B.detach() * w.scale, rtol=0, atol=0)
    y_ref, _, _ = _reference(lin, x, torch.zeros(15, 48), segments)
    assert _close(lin(x, segments).detach(), y_ref, 1e-5)
