"""A decode step's LoRA expands left to the kernels that read the projections' outputs: the SiLU
product adds the gate/up deltas, the kernel that turns the q/k heads (and stores the keys and
values) adds the q/k/v deltas. Each must give what the expand's own launch followed by the
kernel gives, and leave the projection's output as it was."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import kernel_device
from tinsmith.kernels import kv_store
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import rms_norm as rk
from tinsmith.kernels import swiglu
from tinsmith.models import layers


def bank(rows: int, parts: list[int], rank: int, dtype, device, seed: int, slots: int = 4):
    """A packed bank's pieces: ``h`` (rows, parts x rank) fp32, ``B`` (slots, sum of parts, rank),
    ``h_offsets`` per column, each row's slot (some -1), as a bank of ``parts`` would hold them."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, len(parts) * rank, generator=g) * 3).to(device)
    B = (torch.randn(slots, sum(parts), rank, generator=g) * 0.2).to(device, dtype)
    h_offsets = torch.cat([torch.full((n,), j * rank, dtype=torch.int32) for j, n in enumerate(parts)]).to(device)
    idx = torch.tensor([(i * 3) % (slots + 1) - 1 for i in range(rows)], device=device)  # -1 among them
    assert (idx < 0).any() and (idx >= 0).any()
    return h, B, h_offsets, idx


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit where the interpreter runs both (one order of every sum); on a GPU the
    reductions' order may differ by the blocks, so within a step of the dtype."""
    if got.device.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width, rank", [(48, 12), (1500, 40), (256, 64)])
def test_the_silu_product_adds_the_gate_and_up_deltas(dtype, width, rank, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(swiglu, "BACKEND", "triton")
    rows = 7
    g = torch.Generator().manual_seed(width)
    y = (torch.randn(rows, 2 * width, generator=g) * 2).to(device, dtype)
    h, B, h_offsets, idx = bank(rows, [width, width], rank, dtype, device, seed=rank)
    before = y.clone()
    with torch.no_grad():
        assert swiglu.lora_usable(y, h, B)
        got = swiglu.silu_mul(y, (h, B, idx, h_offsets))
        expanded = y.clone()
        lg.expand_triton(expanded, h, B, idx, h_offsets)  # the expand's own launch
        want = swiglu.silu_mul(expanded)
        reference = y.clone()
        lg.expand_parts_torch(reference, h, B, idx, [(0, width), (width, 2 * width)])
    assert torch.equal(y, before)  # the projection's output is only read
    same(got, want)
    act = torch.nn.functional.silu(reference[:, :width]) * reference[:, width:]  # the torch path
    if dtype == torch.float32:
        torch.testing.assert_close(got, act, rtol=1e-5, atol=1e-5)
    else:  # the torch path rounds each delta before adding it, the interpreter toward zero: a few steps
        assert (got.float() - act.float()).abs().max() <= 0.05 * act.float().abs().max()
    assert not torch.equal(got, swiglu.silu_mul(y))  # the deltas are there
    assert not swiglu.lora_usable(y, h[:, :rank], B)  # one part's vectors only
    assert not swiglu.lora_usable(y[:, :width], h, B)  # not the bank's columns


def qkv_case(dtype, device, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n, H, Hk, d, pages, page = 5, 4, 2, 64, 7, 16
    y = (torch.randn(n, (H + 2 * Hk) * d, generator=g) * 2).to(device, dtype)
    h, B, h_offsets, idx = bank(n, [H * d, Hk * d, Hk * d], rank, dtype, device, seed=seed + 1)
    K = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
    V = torch.randn(pages, Hk, page, d, generator=g).to(device, dtype)
    at_page = torch.tensor([3, 1, 6, 3, 0], device=device)
    at = torch.tensor([0, 15, 9, 1, 4], device=device)
    rotary = layers.Rotary(d, layers.RopeConfig(theta=1e6)).to(device)
    cos, sin = rotary(torch.tensor([[3], [40], [17], [0], [9]], device=device), dtype)
    w = [(1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype) for _ in range(2)]
    return dict(y=y, H=H, Hk=Hk, d=d, lora=(h, B, idx, h_offsets), K=K, V=V, page=at_page, at=at, cos=cos, sin=sin,
                w=w)


def views(y, H, Hk, d):
    n = y.shape[0]
    return y[:, : (H + Hk) * d].view(n, 1, H + Hk, d), y[:, (H + Hk) * d:].view(n, 1, Hk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_alone"])
@pytest.mark.parametrize("rank", [8, 40])
def test_the_kernel_turning_q_and_k_adds_the_qkv_deltas_and_stores_them(dtype, norm, rank, monkeypatch):
    """Heads out, keys and values in the pools: as the expand's own launch and then the kernel give
    them (Qwen3's norm and rotary; a Llama's rotary alone), nothing else in the pools moved."""
    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(rk, "BACKEND", "triton")
    c = qkv_case(dtype, device, rank, seed=rank)
    H, Hk, d, y = c["H"], c["Hk"], c["d"], c["y"]
    h, B, idx, h_offsets = c["lora"]
    before = y.clone()

    def run(x, v, K, V, lora=None):
        store = (K, V, v, c["page"], c["at"])
        if norm:
            return rk.rms_norm(x, c["w"][0], 1e-6, (c["cos"], c["sin"]), (H, c["w"][1]), store=store, lora=lora)
        return rk.turn(x, c["cos"], c["sin"], H, store=store, lora=lora)

    with torch.no_grad():
        qk, v = views(y, H, Hk, d)
        assert rk.lora_usable(qk, v, h, B, h_offsets)
        K, V = c["K"].clone(), c["V"].clone()
        got = run(qk, v, K, V, c["lora"])
        expanded = y.clone()
        lg.expand_triton(expanded, h, B, idx, h_offsets)
        want_K, want_V = c["K"].clone(), c["V"].clone()
        want = run(*views(expanded, H, Hk, d), want_K, want_V)
    assert torch.equal(y, before)
    same(got, want)
    same(K, want_K)
    same(V, want_V)
    assert not torch.equal(V, c["V"])  # the values went in with their deltas
    # the values stored are the expanded ones exactly: a value is loaded, added to and stored as is
    assert kv_store.store(c["K"], c["V"], want[:, 0, H:], views(expanded, H, Hk, d)[1][:, 0], c["page"], c["at"])
    same(V, c["V"])
    qk, v = views(y, H, Hk, d)
    assert not rk.lora_usable(qk, v, h, B[:, : (H + Hk) * d], h_offsets)  # a bank without the values' columns
    assert not rk.lora_usable(qk, v, h, B.float() if dtype != torch.float32 else B.half(), h_offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, rank, with_lora", [(48, 12, True), (1500, 40, False), (256, 64, True)])
def test_the_silu_product_takes_the_down_projections_shrink(dtype, width, rank, with_lora, monkeypatch):
    """The product as without it, and each row's down shrink of it (the partial sums of the
    kernel's blocks added up by the row's last program) equal to the gathered shrink of the product
    within fp32 reassociation, zeros for base rows; the tickets back at zero after the call."""
    from tinsmith.kernels import tickets

    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(swiglu, "BACKEND", "triton")
    monkeypatch.setattr(swiglu, "BLOCK", 256)  # several blocks a row, the last one partial
    rows = 7
    g = torch.Generator().manual_seed(width + 1)
    y = (torch.randn(rows, 2 * width, generator=g) * 2).to(device, dtype)
    h, B, h_offsets, idx = bank(rows, [width, width], 8, dtype, device, seed=rank)
    A = (torch.randn(5, rank, width, generator=g) / width**0.5).to(device, dtype)
    lora = (h, B, idx, h_offsets) if with_lora else None
    with torch.no_grad():
        assert swiglu.shrink_usable(rows, A, width)
        out, h_down = swiglu.silu_mul_shrinking(y, lora, A, idx)
        assert torch.equal(out, swiglu.silu_mul(y, lora))
        want = lg.shrink_triton(out, A, idx)  # the gathered shrink of the product as stored (fp32 sums)
    assert h_down.shape == (rows, rank) and h_down.dtype == torch.float32
    torch.testing.assert_close(h_down, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(h_down[idx < 0], torch.zeros_like(h_down[idx < 0]))
    assert int(tickets.counters(torch.device(device))[:rows].abs().sum()) == 0
    assert not swiglu.shrink_usable(rows, A[:, :, :-1], width)  # another input width
    assert not swiglu.shrink_usable(rows, torch.zeros(5, 65, width, device=device), width)  # above one block's rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, rank", [(64, 8), (700, 40)])
def test_the_residual_add_and_norm_adds_the_o_or_down_deltas(dtype, d, rank, monkeypatch):
    """The residual ``x``, the projection's output ``delta`` and its bank's pending expand: the sum
    and the norm come out as the expand's own launch and then the kernel give them (rows wider
    than the kernel's blocks of columns included), ``delta`` unchanged."""
    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(rk, "BACKEND", "triton")
    monkeypatch.setattr(rk, "LORA_BLOCK", 128)  # several blocks a row, the last one partial
    rows = 6
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, 1, d, generator=g) * 2).to(device, dtype)
    delta = torch.randn(rows, 1, d, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    h, B, h_offsets, idx = bank(rows, [d], rank, dtype, device, seed=rank)
    before = delta.clone()
    with torch.no_grad():
        assert rk.add_usable(x, delta, w) and rk.add_lora_usable(x, h, B, h_offsets)
        total, out = rk.add_rms_norm(x, delta, w, 1e-6, (h, B, idx, h_offsets))
        expanded = delta.clone()
        lg.expand_triton(expanded.view(rows, d), h, B, idx)
        want_total, want_out = rk.add_rms_norm(x, expanded, w, 1e-6)
    assert torch.equal(delta, before)
    same(total, want_total)
    same(out, want_out)
    assert not torch.equal(total, rk.add_rms_norm(x, delta, w, 1e-6)[0])  # the deltas are there
    assert not rk.add_lora_usable(x, h, B[:, : d - 1], h_offsets[: d - 1])  # another layer's columns
    assert not rk.add_lora_usable(x, h[:-1], B, h_offsets)  # other rows


def test_an_unexpanded_output_is_finished_where_the_norm_cannot_take_it(monkeypatch):
    """``add_rms_norm`` given an o or down projection's output with its expand pending, where its
    kernel does not run (an offset norm, torch's norms): the deltas are added first, and the sum
    and the norm are the torch path's of the finished output."""
    from tinsmith.models.lora_bank import PendingExpand, Unexpanded

    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(rk, "BACKEND", "torch")
    rows, d, rank = 5, 64, 8
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 1, d, generator=g).to(device)
    y = torch.randn(rows, 1, d, generator=g).to(device)
    h, B, h_offsets, idx = bank(rows, [d], rank, torch.float32, device, seed=2)
    finished = y.clone()
    lg.expand_torch(finished.view(rows, d), h, B, idx)
    norm = layers.RMSNorm(d, 1e-6).to(device)
    with torch.no_grad():
        total, out = layers.add_rms_norm(x, Unexpanded(y, PendingExpand(h, B, idx, h_offsets, None)), norm)
        want_total = x + finished
        torch.testing.assert_close(total, want_total, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, norm(want_total), rtol=1e-6, atol=1e-6)


def test_a_step_falls_back_to_the_expand_where_the_kernel_cannot_take_it(monkeypatch):
    """``turn_and_store`` given a bank's pending expand it cannot take (a bank of another dtype) adds
    it into the packed output itself, so the caller's paths read the deltas there."""
    from tinsmith.models.lora_bank import PendingExpand

    device = kernel_device()
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(rk, "BACKEND", "triton")
    c = qkv_case(torch.bfloat16, device, 8, seed=3)
    H, Hk, d, y = c["H"], c["Hk"], c["d"], c["y"]
    h, B, idx, h_offsets = c["lora"]
    columns = [(0, H * d), (H * d, (H + Hk) * d), ((H + Hk) * d, (H + 2 * Hk) * d)]
    pending = PendingExpand(h, B.float(), idx, h_offsets, columns)
    before, want = y.clone(), y.clone()
    lg.expand_parts_torch(want, h, B.float(), idx, columns)
    with torch.no_grad():
        qk, v = views(y, H, Hk, d)
        turned = layers.turn_and_store(qk, c["cos"], c["sin"], H, v, (c["K"], c["V"], c["page"], c["at"]),
                                       (c["w"][0], 1e-6, c["w"][1]), (pending, y))
    assert turned is not None  # the heads turned and stored all the same
    assert not torch.equal(y, before)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=0.05)  # the deltas added into y


def test_a_sampler_mixing_adapters_samples_what_torch_samples_with_fewer_expands(qwen3_dir, monkeypatch):
    """A paged sampler decoding rows of two adapters and the base model, every kernel on: the same
    tokens and logprobs as the torch path, and each decode step's layers launched no expand for
    q/k/v, o, gate/up or down (their kernels took them); only the LM head's is left, and no shrink
    for down (the SiLU product took it). With the expands and shrinks left to their own launches,
    or only the norms' expands so left, the same again."""
    import numpy as np

    from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, task
    from tinsmith.models import lora as lora_mod
    from tinsmith.models import lora_bank

    if kernel_device() != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    model = fresh_model(qwen3_dir)
    random_adapter(model, 1_000_001, rank=4, seed=1)
    random_adapter(model, 1_000_002, rank=8, seed=2)
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    expands: list[int] = []
    shrinks: list[int] = []
    real_expand, real_shrink = lg.expand_triton, lg.shrink_triton

    def counted(y, *args, **kwargs):
        expands.append(y.shape[1])
        return real_expand(y, *args, **kwargs)

    def counted_shrink(x, *args, **kwargs):
        shrinks.append(x.shape[1])
        return real_shrink(x, *args, **kwargs)

    monkeypatch.setattr(lg, "expand_triton", counted)
    monkeypatch.setattr(lg, "shrink_triton", counted_shrink)
    prompts = [np.random.default_rng(i).integers(4, 400, 9 + 6 * i).tolist() for i in range(3)]
    slots = [1_000_001, None, 1_000_002]
    cfg = model.config
    qkv, gate_up = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, 2 * cfg.intermediate_size
    results, widths, inputs = {}, {}, {}
    every = frozenset({"heads", "silu", "norms"})
    for name, backend, taken in (("torch", "torch", every), ("kernels", "triton", every),
                                 ("apart", "triton", frozenset()), ("not_norms", "triton", every - {"norms"})):
        for module in (lg, rk, swiglu, kv_store):
            monkeypatch.setattr(module, "BACKEND", backend)
        monkeypatch.setattr(lora_bank, "EXPANDS_TAKEN", taken)
        monkeypatch.setattr(lora_bank, "SHRINKS_TAKEN", frozenset() if name == "apart" else frozenset({"silu"}))
        expands.clear()
        shrinks.clear()
        sampler = make_sampler(model, qwen3_dir, kv_layout="paged")
        results[name] = run(sampler, [task(f"p{i}", p, slot=s, max_tokens=6, temperature=1.0, seed=i, stop=[])
                                      for i, (p, s) in enumerate(zip(prompts, slots))])
        widths[name], inputs[name] = set(expands), set(shrinks)
    assert not widths["torch"]
    hidden, vocab = cfg.hidden_size, cfg.vocab_size  # o and down write the hidden size
    assert widths["apart"] == {qkv, gate_up, hidden, vocab}  # their own launches when left apart...
    assert widths["kernels"] == {vocab}  # ...and only the LM head's when taken
    assert widths["not_norms"] == {hidden, vocab}  # o and down on their own, as asked
    inner = cfg.intermediate_size  # the down projection's input, which the SiLU product shrinks when asked
    assert inner in inputs["apart"] and inner not in inputs["kernels"] and inner not in inputs["not_norms"]
    for name in ("kernels", "apart", "not_norms"):
        for key, want in results["torch"].items():
            got = results[name][key].sequences[0]
            assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), (name, key)
            np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-4, atol=1e-4)
