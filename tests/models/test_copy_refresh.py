"""An adapter's compute copies and stack rows refreshed after each optimizer step from lists made
once: the copies equal the masters after every refresh, whoever else refreshed in between; a
cache replaced by anyone else (a stack rebuilt for another mix of tenants, a parked adapter)
makes the lists again; a group's stacks are views of its side-by-side buffer, which a refresh
writes (no concatenation at the next forward)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_lora_tenants import _group_layers, _layer, _segments
from tinsmith.kernels import block_copy
from tinsmith.kernels.guard import triton_interpreting
from tinsmith.models import copy_refresh, moe
from tinsmith.models.copy_refresh import CopyRefresh
from tinsmith.models.lora import trained_together


def _step(*ws) -> None:
    """What an optimizer step does to the masters: an in-place change (versions bumped)."""
    with torch.no_grad():
        for w in ws:
            w.A.add_(0.25)
            w.B.mul_(1.5)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16)


def _assert_stack_current(lin, slot: int, row: int) -> None:
    w, st = lin.adapters[slot], lin._tenant_stack
    r = w.A.shape[0]
    torch.testing.assert_close(st.A[row, :r], _bf16(w.A), rtol=0, atol=0)
    torch.testing.assert_close(st.B[row, :, :r], _bf16(w.B) * w.scale, rtol=0, atol=0)


def _stacked(monkeypatch) -> tuple[list, object, torch.Tensor]:
    """(the lists CopyRefresh works out, counted; a bf16 layer of adapters 0 and 1 whose stack
    one forward/backward made, the grouped matmul forced; its input)."""
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    made: list = []
    real = CopyRefresh._make
    monkeypatch.setattr(CopyRefresh, "_make", lambda self: (made.append(self), real(self)))
    lin = _layer(torch.bfloat16, bias=False)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    lin(x, _segments()).sum().backward()
    return made, lin, x


def test_tenants_refreshing_in_turn_keep_their_lists_and_every_stack_current(monkeypatch):
    made, lin, x = _stacked(monkeypatch)
    stack = lin._tenant_stack
    plans = {s: CopyRefresh({torch.bfloat16: [lin.adapters[s]]}, {}, [(lin, lin.adapters[s])]) for s in (0, 1)}
    for _ in range(3):
        for slot, row in ((0, 0), (1, 2)):
            _step(lin.adapters[slot])
            plans[slot].refresh()
            _assert_stack_current(lin, slot, row)
            w = lin.adapters[slot]
            torch.testing.assert_close(w.copies[1], _bf16(w.A), rtol=0, atol=0)
            torch.testing.assert_close(w.copies[2], _bf16(w.B), rtol=0, atol=0)
    assert len(made) == 2  # one each: the other tenant's refresh left each one's caches in place
    assert lin._tenant_stack is stack
    lin(x, _segments())
    assert lin._tenant_stack is stack  # the keys followed: the forward rebuilt nothing


def test_a_stack_rebuilt_for_another_mix_of_tenants_is_found_again(monkeypatch):
    made, lin, x = _stacked(monkeypatch)
    w = lin.adapters[1]
    plan = CopyRefresh({}, {}, [(lin, w)])
    plan.refresh()
    lin(x, _segments([(1, 6), (0, 9)]))  # another mix: a new stack, adapter 1 in row 0
    assert len(made) == 1
    _step(w)
    plan.refresh()
    assert len(made) == 2
    _assert_stack_current(lin, 1, 0)
    lin.forget_stacked_copies()  # e.g. an adapter parked off the device
    _step(w)
    plan.refresh()  # nothing to write, nothing stale left behind
    assert lin._tenant_stack is None and len(made) == 3


def test_copies_replaced_elsewhere_are_written_again(monkeypatch):
    made, lin, _ = _stacked(monkeypatch)
    w = lin.adapters[0]
    plan = CopyRefresh({torch.bfloat16: [w]}, {}, [])
    plan.refresh()
    w.copies = None  # as parking does
    _step(w)
    plan.refresh()
    assert len(made) == 2
    torch.testing.assert_close(w.copies[1], _bf16(w.A), rtol=0, atol=0)
    assert copy_refresh.copy_key(w, torch.bfloat16) == w.copies[0]


def test_a_groups_stacks_are_views_of_its_buffers_which_a_refresh_writes(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layers = _group_layers(torch.bfloat16)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    trained_together(layers, x, _segments())
    A_cat, B_cat, _ = layers[0]._tenant_cat
    rank = A_cat.shape[1] // len(layers)
    start = 0
    for p, layer in enumerate(layers):
        assert layer._tenant_stack.A.data_ptr() == A_cat[:, p * rank].data_ptr()
        assert layer._tenant_stack.B.data_ptr() == B_cat[:, start, p * rank].data_ptr()
        start += layer.out_features
    ws = [layer.adapters[1] for layer in layers]
    _step(*ws)
    CopyRefresh({}, {}, [(layer, w) for layer, w in zip(layers, ws)]).refresh()
    start = 0
    for p, (layer, w) in enumerate(zip(layers, ws)):
        r, out = w.A.shape[0], layer.out_features
        torch.testing.assert_close(A_cat[2, p * rank:p * rank + r], _bf16(w.A), rtol=0, atol=0)
        torch.testing.assert_close(B_cat[2, start:start + out, p * rank:p * rank + r],
                                   (w.B.detach() * w.scale).to(torch.bfloat16), rtol=0, atol=0)
        start += out
    # Off its own block, a part's rows of B stay zero: its output reads only its own rank's columns.
    mask = torch.zeros_like(B_cat, dtype=torch.bool)
    start = 0
    for p, layer in enumerate(layers):
        mask[:, start:start + layer.out_features, p * rank:(p + 1) * rank] = True
        start += layer.out_features
    assert not B_cat[~mask].any()
    trained_together(layers, x, _segments())
    assert layers[0]._tenant_cat[0] is A_cat and layers[0]._tenant_cat[1] is B_cat  # nothing rebuilt after the step


def test_parked_and_unparked_tenants_train_as_if_all_stayed(qwen3_dir, monkeypatch):
    """bf16 tenants trained two at a time (grouped, forced) on a runtime with room for two: each
    step parks one adapter off the device and brings another back, so its compute copies and
    stacks are remade or refreshed. Step for step it trains exactly as a runtime where all stay."""
    from bench.gpu.train import batch
    from tinsmith.models.loading import load_model
    from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec
    from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    runtimes, units = [], []
    for slots in (2, 8):
        rt = TrainingRuntime(load_model(str(qwen3_dir), dtype=torch.bfloat16).model, max_lora_adapters=slots,
                             max_lora_rank=8)
        runtimes.append(rt)
        units.append([rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(3)])
    data = [batch(runtimes[0].config.vocab_size, 2, 12, seed=i) for i in range(3)]
    parked = 0
    for a, b in ((0, 1), (1, 2), (2, 0), (0, 1), (1, 2)):
        losses = []
        for rt, us in zip(runtimes, units):
            reqs = [TrainRequest(us[i], ForwardBackwardInput(data[i], "cross_entropy")) for i in (a, b)]
            losses.append([r.metrics["loss:sum"] for r in rt.forward_backward(reqs)])
            for i in (a, b):
                rt.optim_step(us[i], AdamParams(learning_rate=1e-2))
        assert losses[0] == losses[1], (a, b)
        parked += sum(not runtimes[0].unit(u).resident for u in units[0])
    assert parked >= 4  # the tight runtime did park and unpark
    # What the next forward computes with is what the masters are now, in both runtimes.
    for rt in runtimes:
        stacks = [m for m in rt.model.modules() if getattr(m, "_tenant_stack", None) is not None]
        assert stacks
        for layer in stacks:
            st = layer._tenant_stack
            for i, w in enumerate(st.weights):
                r = w.A.shape[0]
                torch.testing.assert_close(st.A[i, :r], _bf16(w.A), rtol=0, atol=0)
                torch.testing.assert_close(st.B[i, :, :r], _bf16(w.B) * w.scale, rtol=0, atol=0)
        for unit in rt.units.values():
            for _, w in (unit.attachments if unit.resident else ()):
                if w.copies is not None:
                    torch.testing.assert_close(w.copies[1], _bf16(w.A), rtol=0, atol=0)
    for ut, ur in zip(units[0], units[1]):
        for (n, x), (_, y) in zip(runtimes[0].unit(ut).named_params, runtimes[1].unit(ur).named_params):
            assert torch.equal(x.detach().cpu(), y.detach().cpu()), n


@pytest.mark.parametrize("blocks_by", ["torch", "triton"])
def test_a_groups_strided_blocks_are_copied_apart_from_the_dense_pairs(monkeypatch, blocks_by):
    """A group's B stack is block-diagonal, so each of its blocks is a strided view. On a GPU one
    such view in a multi-tensor copy sends every pair of the list to a kernel of its own; the
    refresh keeps them apart (one block-copy launch for all of them), and its multi-tensor copy
    holds only dense pairs laid out alike."""
    if blocks_by == "triton" and not (block_copy.triton is not None and triton_interpreting()):
        pytest.skip("the block copy kernel runs on a CPU only in Triton's interpreter")
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    monkeypatch.setattr(block_copy, "BACKEND", blocks_by)
    layers = _group_layers(torch.bfloat16)
    trained_together(layers, torch.randn(15, 64, dtype=torch.bfloat16), _segments())
    ws = [layer.adapters[1] for layer in layers]
    plan = CopyRefresh({torch.bfloat16: ws}, {}, [(layer, w) for layer, w in zip(layers, ws)])
    plan.refresh()
    (ds, ss), = plan._copies_by_route.values()
    assert len(ds) == 3 * len(ws)  # each adapter's two compute copies and its A rows of the stack
    assert all(copy_refresh.dense(d) and copy_refresh.dense(s) and copy_refresh.laid_out_alike(d, s)
               for d, s in zip(ds, ss))
    blocks = plan._blocks
    B_cat = layers[0]._tenant_cat[1]
    assert len(blocks) == len(ws) and all(b.data_ptr() >= B_cat.data_ptr() and not b.is_contiguous() for b in blocks.dst)
    assert blocks.scales == [float(w.scale) for w in ws] and not plan._scaled
    for _ in range(2):  # the kernel's table, made at the first refresh, still right at the next
        _step(*ws)
        plan.refresh()
        for layer, w in zip(layers, ws):
            st, r = layer._tenant_stack, w.A.shape[0]
            torch.testing.assert_close(st.A[2, :r], _bf16(w.A), rtol=0, atol=0)
            # the interpreter rounds to bf16 its own way (a GPU rounds as torch: tests/gpu)
            torch.testing.assert_close(st.B[2, :, :r].float(), (_bf16(w.B) * w.scale).float(), atol=0,
                                       rtol=0 if blocks_by == "torch" else 2 ** -6)
            torch.testing.assert_close(w.copies[2], _bf16(w.B), rtol=0, atol=0)
