"""An adapter's compute copies and stack rows refreshed after each optimizer step from lists made
once: the copies equal the masters after every refresh, whoever else refreshed in between; a
cache replaced by anyone else (a stack rebuilt for another mix of tenants, a parked adapter)
makes the lists again; a group's stacks are views of its side-by-side buffer, which a refresh
writes (no concatenation at the next forward)."""

from __future__ import annotations

import torch

from tests.models.test_lora_tenants import _group_layers, _layer, _segments
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


def test_a_groups_stacks_are_views_of_its_buffer_which_a_refresh_writes(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layers = _group_layers(torch.bfloat16)
    x = torch.randn(15, 64, dtype=torch.bfloat16)
    trained_together(layers, x, _segments())
    A_cat, _ = layers[0]._tenant_cat
    rank = A_cat.shape[1] // len(layers)
    for p, layer in enumerate(layers):
        assert layer._tenant_stack.A.data_ptr() == A_cat[:, p * rank].data_ptr()
    ws = [layer.adapters[1] for layer in layers]
    _step(*ws)
    CopyRefresh({}, {}, [(layer, w) for layer, w in zip(layers, ws)]).refresh()
    for p, (layer, w) in enumerate(zip(layers, ws)):
        torch.testing.assert_close(A_cat[2, p * rank:p * rank + w.A.shape[0]], _bf16(w.A), rtol=0, atol=0)
    trained_together(layers, x, _segments())
    assert layers[0]._tenant_cat[0] is A_cat  # no new concatenation after the step
