"""The decode step's row bookkeeping kernel gives exactly what the torch ops give: positions, seen
key counts, pages and offsets (padding rows on the scratch page), and a sampler whose steps take
it samples what the torch ops' sampler samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import step_rows
from tinsmith.sampling.kv_cache import StepRows

PAGE = 64


def _case(n: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = 6
    lengths = torch.randint(0, width * PAGE, (n + 3,), generator=g)  # the cache holds more rows than the step
    live = (torch.rand(n, generator=g) < 0.7).long()
    live[-1] = 0 if n > 1 else 1  # a padding row wherever there are two rows
    rope = torch.randint(-5, 40, (n,), generator=g)
    table = torch.randint(1, 500, (n + 3, width), generator=g, dtype=torch.int32)
    return [t.to(device) for t in (lengths, live, rope, table)]


@pytest.mark.parametrize("n", [1, 5, 64, 300])  # 300: two programs of rows
@pytest.mark.parametrize("with_live", [True, False])
@pytest.mark.parametrize("with_rope", [True, False])
@pytest.mark.parametrize("paged", [True, False])
def test_the_kernel_gives_what_the_torch_ops_give(n, with_live, with_rope, paged, monkeypatch):
    device = kernel_device()
    lengths, live, rope, table = _case(n, device, seed=n)
    live = live if with_live else None
    rope = rope if with_rope else None
    table = table[:n] if paged else None
    monkeypatch.setattr(step_rows, "BACKEND", "torch")
    want = StepRows(lengths, n, live, rope, table, PAGE, 0)
    assert want._slots is None and want._seen is None  # the torch ops wait to be asked
    monkeypatch.setattr(step_rows, "BACKEND", "triton")
    got = StepRows(lengths, n, live, rope, table, PAGE, 0)
    assert got._seen is not None  # all in the one launch
    assert torch.equal(got.pos, want.pos) and got.pos.dtype == torch.long
    assert torch.equal(got.seen(), want.seen())
    if rope is None:
        assert got.positions is None and want.positions is None
    else:
        assert torch.equal(got.positions, want.positions)
    if paged:
        for a, b in zip(got.slots(), want.slots()):
            assert torch.equal(a, b) and a.dtype == torch.long
        if live is not None and n > 1:  # padding rows: the scratch page's first offset
            page, at = got.slots()
            dead = live == 0
            assert dead.any() and (page[dead] == 0).all() and (at[dead] == 0).all()
    # the torch paths' row indices and padding mask, only where asked
    assert torch.equal(got.rows(), torch.arange(n, device=device))
    assert (got.keep() is None) == (live is None)


def test_the_values_are_the_steps_own():
    """The torch reference, by hand: a live row decodes at its length, a padding row at 0."""
    lengths = torch.tensor([5, 64, 130, 7, 99])
    live = torch.tensor([1, 1, 1, 0])
    table = torch.arange(5 * 3, dtype=torch.int32).reshape(5, 3) + 100
    r = StepRows(lengths, 4, live, torch.tensor([0, 2, 0, 9]), table[:4], PAGE, 0)
    assert r.pos.tolist() == [5, 64, 130, 0]
    assert r.seen().tolist() == [6, 65, 131, 1]
    assert r.positions.tolist() == [5, 66, 130, 9]
    page, at = r.slots()
    assert page.tolist() == [100, 104, 108, 0] and at.tolist() == [5, 0, 2, 0]


def test_rows_past_the_buffers_are_refused():
    lengths, table = torch.zeros(4, dtype=torch.long), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="5 rows"):
        step_rows.compute(lengths, 5)
    with pytest.raises(ValueError, match="page table of 3"):
        step_rows.compute(lengths, 4, table=table)


def test_dispatch_follows_backend(monkeypatch):
    lengths = torch.zeros(4, dtype=torch.long)
    monkeypatch.setattr(step_rows, "BACKEND", "torch")
    assert not step_rows.usable(lengths)
    monkeypatch.setattr(step_rows, "BACKEND", "auto")
    assert step_rows.usable(lengths) == (step_rows.triton is not None and lengths.is_cuda)
    monkeypatch.setattr(step_rows, "BACKEND", "triton")
    assert step_rows.usable(lengths) == (step_rows.triton is not None)
    assert not step_rows.usable(lengths.int())  # the cache's int64 lengths only


@pytest.mark.parametrize("kv_layout", ["paged", "rows"])
def test_a_sampler_through_the_kernel_samples_what_torch_samples(model_dirs, monkeypatch, kv_layout):
    """Eager and static steps (the static one with padding rows: three live rows in a bucket of
    four), rows crossing into new pages, against the torch ops' sampler; the decode attention
    kernel reads the key counts in both, so a wrong count or slot shows in the tokens."""
    from tests.sampling.conftest import fresh_model, make_sampler, run, task
    from tinsmith.kernels import decode_attention
    from tinsmith.sampling.decode_graphs import DecodeGraphs

    if kernel_device(runtime_loop_bounds=True) != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    monkeypatch.setattr(decode_attention, "BACKEND", "triton")
    prompts = [np.random.default_rng(i).integers(4, 400, 30 + 25 * i).tolist() for i in range(3)]
    launches = []
    real = step_rows._launch
    monkeypatch.setattr(step_rows, "_launch", lambda *a: launches.append(1) or real(*a))
    for static in (False, True):
        results = {}
        for backend in ("torch", "triton"):
            monkeypatch.setattr(step_rows, "BACKEND", backend)
            model = fresh_model(model_dirs["qwen3"])
            sampler = make_sampler(model, model_dirs["qwen3"], kv_layout=kv_layout)
            if static:
                sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
            results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=24, temperature=1.0, seed=i, stop=[])
                                             for i, p in enumerate(prompts)])
            if static:
                assert sampler.stats["static_steps"] > 0
        assert launches, "the kernel ran"
        launches.clear()
        for key, want in results["torch"].items():
            got = results["triton"][key].sequences[0]
            assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), (static, key)
            np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-5, atol=1e-6)


_COMPILE = BUILD_PRELUDE + '''
from tinsmith.kernels import step_rows

sig = {"lengths_ptr": "*i64", "live_ptr": "*i64", "rope_ptr": "*i64", "table_ptr": "*i32", "pos_ptr": "*i64",
       "seen_ptr": "*i64", "positions_ptr": "*i64", "page_ptr": "*i64", "at_ptr": "*i64", "n": "i32",
       "stride_table": "i64", "page_size": "i32", "scratch": "i32"}
for live, rope, paged, pdl in ((True, True, True, True), (False, False, False, False), (True, False, True, False)):
    build(step_rows._rows_kernel, sig, {"LIVE": live, "ROPE": rope, "PAGED": paged, "BLOCK": 256, "PDL": pdl})
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernel for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path)
