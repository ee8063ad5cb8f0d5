"""Adapter banks: the decode path over stacked adapters equals the per-adapter path, and the
banks follow every change of the adapters (steps, loads, removal, rank growth, new slots)."""

from __future__ import annotations

import pytest
import torch

from tinsmith.kernels import lora_gather
from tinsmith.models import lora as lora_mod
from tinsmith.models.lora import LoraLinear, PackedProjection, decode_rows, sync_banks
from tinsmith.models.lora_bank import RowSlots, SlotTable, adapters_changed
from tinsmith.types import AdamParams

from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, task, training_adapters
from tests.sampling.test_sampler import prompts


class Holder(torch.nn.Module):
    """Stands for the model that owns the slot table."""


def grouped(layer, x, slots):
    groups = [(s, torch.tensor([i for i, t in enumerate(slots) if t == s])) for s in {s for s in slots if s is not None}]
    with torch.inference_mode():
        return layer(x, groups)


def banked(layer, owner, x, slots):
    with torch.inference_mode():
        return layer(x, RowSlots.of(owner, slots, x.device))


def test_bank_layer_equals_grouped_layer_through_changes():
    g = torch.Generator().manual_seed(0)
    layer = LoraLinear(24, 40)
    torch.nn.init.normal_(layer.weight, generator=g)
    for slot, rank in ((1, 4), (2, 8), (3, 2)):
        w = layer.add_adapter(slot, rank, 2.0 * rank, g)
        with torch.no_grad():
            w.B.normal_(generator=g)
    owner = Holder()
    owner.layer = layer
    x = torch.randn(9, 24, generator=g)
    slots = [1, None, 2, 3, 1, 2, None, 3, 1]
    torch.testing.assert_close(banked(layer, owner, x, slots), grouped(layer, x, slots), rtol=1e-5, atol=1e-5)
    bank = layer._bank
    assert bank.rank == 8 and tuple(bank.A.shape[1:]) == (8, 24)

    # A weight written in place (as optimizer steps and loads do, who announce it) is seen.
    with torch.no_grad():
        layer.adapters[2].B.mul_(3.0)
    adapters_changed()
    torch.testing.assert_close(banked(layer, owner, x, slots), grouped(layer, x, slots), rtol=1e-5, atol=1e-5)

    # Removal: its rows read the base model. A larger rank: the bank grows.
    layer.remove_adapter(3)
    w = layer.add_adapter(4, 16, 8.0, g)
    with torch.no_grad():
        w.B.normal_(generator=g)
    slots2 = [1, 3, 4, None, 4, 2, 3, 1, 4]
    torch.testing.assert_close(banked(layer, owner, x, slots2), grouped(layer, x, slots2), rtol=1e-5, atol=1e-5)
    assert layer._bank.rank == 16
    base = torch.nn.functional.linear(x, layer.weight)
    out = banked(layer, owner, x, slots2)
    torch.testing.assert_close(out[[1, 3, 6]], base[[1, 3, 6]])  # slot 3 is gone, row 3 has none


def test_slot_table_reuses_positions_and_grows():
    t = SlotTable(capacity=2)
    t.assign({10, 11})
    p10 = t.positions[10]
    t.assign({10, 12})  # 11 is not read: its position goes to 12
    assert t.positions[10] == p10 and t.capacity == 2 and set(t.positions) == {10, 12}
    t.assign({10, 12, 13})
    assert t.capacity == 4 and set(t.positions) == {10, 12, 13}
    assert len(set(t.positions.values())) == 3


def _layer_with_adapters(ranks: dict[int, int]) -> tuple[Holder, LoraLinear, torch.Generator]:
    g = torch.Generator().manual_seed(1)
    owner = Holder()
    owner.layer = layer = LoraLinear(24, 40)
    torch.nn.init.normal_(layer.weight, generator=g)
    for slot, rank in ranks.items():
        w = layer.add_adapter(slot, rank, 2.0 * rank, g)
        with torch.no_grad():
            w.B.normal_(generator=g)
    return owner, layer, g


def test_bank_gives_back_what_removed_adapters_held():
    ranks = {s: 4 for s in range(1, 21)} | {21: 16}
    owner, layer, g = _layer_with_adapters(ranks)
    x = torch.randn(21, 24, generator=g)
    every = list(range(1, 22))
    torch.testing.assert_close(banked(layer, owner, x, every), grouped(layer, x, every), rtol=1e-5, atol=1e-5)
    assert (layer._bank.positions, layer._bank.rank) == (32, 16)

    for slot in range(4, 22):  # runs end: three rank-4 adapters stay
        layer.remove_adapter(slot)
    few = [1, 2, 3, None, 2, 1, 3] * 3
    torch.testing.assert_close(banked(layer, owner, x, few), grouped(layer, x, few), rtol=1e-5, atol=1e-5)
    table = SlotTable.of(owner)
    assert table.capacity == 8 and set(table.positions) == {1, 2, 3}
    assert max(table.positions.values()) < 8
    assert tuple(layer._bank.A.shape) == (8, 4, 24) and tuple(layer._bank.B.shape) == (8, 40, 4)

    # A layer left with no adapter drops its bank at the next decode batch.
    other = LoraLinear(24, 40)
    owner.other = other
    for slot in (1, 2, 3):
        layer.remove_adapter(slot)
    w = other.add_adapter(9, 4, 8.0, g)
    with torch.no_grad():
        w.B.normal_(generator=g)
    banked(other, owner, x, [9] * 10 + [None] * 11)
    assert layer._bank is None and set(table.positions) == {9}


def test_released_table_never_moves_the_slots_of_the_batch_being_laid_out():
    owner, layer, g = _layer_with_adapters({2: 4, 3: 4})
    table = SlotTable(capacity=16, positions={1: 0, 2: 9, 3: 14})  # slot 1's adapter is gone
    owner._lora_slot_table = table
    table.release(owner, keep={3})
    assert table.capacity == 16 and table.positions == {2: 9, 3: 14}  # 3 pins the range
    adapters_changed()
    table.release(owner, keep={2})
    assert table.capacity == 16 and table.positions == {2: 9, 3: 14}
    adapters_changed()
    version = table.version
    table.release(owner, keep=set())
    assert table.capacity == 4 and sorted(table.positions.values()) == [0, 1] and table.version > version


def test_bank_keeps_its_buffers_while_a_full_table_rotates():
    owner, layer, g = _layer_with_adapters({1: 4, 2: 16, 3: 4, 4: 4, 5: 4})
    x = torch.randn(4, 24, generator=g)
    banked(layer, owner, x, [1, 2, 3, 4])
    A = layer._bank.A
    for slots in ([1, 3, 4, 5], [1, 2, 3, 4], [5, 3, 4, 1]):  # slot 2 (rank 16) loses its position, then regains it
        torch.testing.assert_close(banked(layer, owner, x, slots), grouped(layer, x, slots), rtol=1e-5, atol=1e-5)
        assert layer._bank.A is A and layer._bank.rank == 16


def test_packed_projection_fuses_its_layers_adapters_into_one_bank():
    """q/k/v-like layers of one packed buffer: one shrink and one expand over a bank with a part per
    layer equal each layer's own adapter; an adapter that skips a layer adds nothing there; the
    layers keep no banks of their own; the packed bank follows changes and is freed with them."""
    g = torch.Generator().manual_seed(2)
    owner = Holder()
    owner.q, owner.k, owner.v = layers = [LoraLinear(24, n) for n in (32, 16, 16)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, generator=g)
    owner.packed_qkv = packed = PackedProjection(layers)
    for slot, rank, targets in ((1, 4, layers), (2, 8, layers), (3, 2, layers[:1])):
        for layer in targets:
            w = layer.add_adapter(slot, rank, 2.0 * rank, g)
            with torch.no_grad():
                w.B.normal_(generator=g)
    x = torch.randn(9, 24, generator=g)
    slots = [1, None, 2, 3, 1, 2, None, 3, 1]

    def separately(slots):
        return torch.cat([grouped(layer, x, slots) for layer in layers], dim=1)

    def fused(slots):
        with torch.inference_mode():
            return packed.project(x, RowSlots.of(owner, slots, x.device))

    torch.testing.assert_close(fused(slots), separately(slots), rtol=1e-5, atol=1e-5)
    bank = packed._bank
    assert bank.parts == 3 and bank.rank == 8 and tuple(bank.A.shape[1:]) == (24, 24)
    assert all(layer._bank is None for layer in layers)
    assert sync_banks(owner, RowSlots.of(owner, slots, x.device)) == (
        (id(packed), bank.A.data_ptr(), bank.B.data_ptr(), 8),)

    with torch.no_grad():  # a step writes in place; the owner of the weights says so
        layers[1].adapters[2].B.mul_(-2.0)
    adapters_changed()
    torch.testing.assert_close(fused(slots), separately(slots), rtol=1e-5, atol=1e-5)
    for layer in layers:
        layer.remove_adapter(2)
    torch.testing.assert_close(fused(slots), separately(slots), rtol=1e-5, atol=1e-5)
    assert packed._bank.rank == 4
    for layer in layers:
        for slot in (1, 3):
            layer.remove_adapter(slot)
    RowSlots.of(owner, [None], x.device)
    assert packed._bank is None


def test_decode_rows_layouts(monkeypatch):
    owner = Holder()
    assert decode_rows(owner, [None, None], torch.device("cpu")) is None
    assert decode_rows(owner, [5, 5, 5], torch.device("cpu")) == [(5, 0, 3)]
    monkeypatch.setattr(lora_mod, "CPU_BANK_MIN_ADAPTERS", 3)
    assert isinstance(decode_rows(owner, [5, None, 7], torch.device("cpu")), list)  # auto, 2 adapters: grouped
    assert isinstance(decode_rows(owner, [5, 6, 7], torch.device("cpu")), RowSlots)  # auto, 3: bank
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    rows = decode_rows(owner, [5, None, 7], torch.device("cpu"))
    assert isinstance(rows, RowSlots) and rows.idx.tolist()[1] == -1
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "grouped")
    rows = decode_rows(owner, [5, None, 7], torch.device("cpu"))
    assert [(s, ix.tolist()) for s, ix in rows] == [(5, [0]), (7, [2])]


def _mixed_run(model, model_dir, slots, mode, monkeypatch, backend="torch", n=2, max_tokens=8):
    monkeypatch.setattr(lora_mod, "DECODE_LORA", mode)
    monkeypatch.setattr(lora_gather, "BACKEND", backend)
    V = model.config.vocab_size
    ps = prompts(3, (5, 9, 3), V)
    tasks = [task((i, s), ps[i % 3], slot=s, n=n, max_tokens=max_tokens, stop=[], temperature=0.9, seed=i)
             for i, s in enumerate(slots)]
    return run(make_sampler(model, model_dir), tasks)


def _same(a, b):
    for key in a:
        for sa, sb in zip(a[key].sequences, b[key].sequences):
            assert sa.tokens.tolist() == sb.tokens.tolist(), key
            assert abs(sa.logprobs - sb.logprobs).max() < 1e-4, key


@pytest.mark.parametrize("fixture", ["qwen3_dir", "qwen3_moe_dir"])
def test_sampler_bank_path_equals_grouped_path(fixture, request, monkeypatch):
    """Mixed adapters (a snapshot, a training run targeting only MLPs, a stepped run, the base)
    decode to the same tokens on both paths, also after the run takes an optimizer step."""
    model_dir = request.getfixturevalue(fixture)
    model = fresh_model(model_dir)
    random_adapter(model, 1_000_001, rank=4, seed=1)
    g = torch.Generator().manual_seed(7)
    rt, unit, mlp_only = training_adapters(model, g)
    adapters_changed()
    slots = [1_000_001, None, rt.unit(unit).slot, rt.unit(mlp_only).slot]
    ref = _mixed_run(model, model_dir, slots, "grouped", monkeypatch)
    _same(ref, _mixed_run(model, model_dir, slots, "bank", monkeypatch))

    # An optimizer step changes the run's weights in place: the bank must follow.
    tr = rt.unit(unit)
    for p in tr.params:
        p.grad = torch.randn(p.shape, generator=g)
    tr.step(AdamParams(learning_rate=0.05))
    ref2 = _mixed_run(model, model_dir, slots, "grouped", monkeypatch)
    assert any(ref2[k].sequences[0].tokens.tolist() != ref[k].sequences[0].tokens.tolist() for k in ref)
    _same(ref2, _mixed_run(model, model_dir, slots, "bank", monkeypatch))


def test_sampler_bank_path_with_triton_kernels(qwen3_dir, monkeypatch):
    if not lora_gather.triton_available():
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]' or '[test]')")
    if not lora_gather.triton_interpreting():
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    model = fresh_model(qwen3_dir)
    random_adapter(model, 1_000_001, rank=4, seed=1)
    random_adapter(model, 1_000_002, rank=8, seed=2)
    slots = [1_000_001, None, 1_000_002]
    ref = _mixed_run(model, qwen3_dir, slots, "grouped", monkeypatch, n=1, max_tokens=3)
    _same(ref, _mixed_run(model, qwen3_dir, slots, "bank", monkeypatch, backend="triton", n=1, max_tokens=3))
