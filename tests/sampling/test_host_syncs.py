"""The sampler's hot loops wait for the device only where they must.

On a GPU every read of a device value, and every host-to-device copy that is not
``non_blocking``, makes the host wait for all queued kernels (see
:mod:`tinsmith.devtools.host_syncs`, which finds them on a CPU). A decode burst reads its
sampled tokens and their logprobs back once each and copies nothing, whatever rows cross a page
boundary, whatever adapters and family; an admission reads its first tokens back once, however
many requests and rows it seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinsmith.models.moe as moe
from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, task
from tinsmith.devtools.host_syncs import HostSyncs
from tinsmith.sampling.decode_graphs import DecodeGraphs

BURSTS, BURST = 3, 4


def _sampler(model_dir, layout: str, static: bool, adapters: int):
    model = fresh_model(model_dir)
    for a in range(adapters):
        random_adapter(model, a + 1, seed=a)
    sampler = make_sampler(model, model_dir, kv_layout=layout, decode_burst=BURST)
    if static:  # the CUDA-graph step's code, run uncaptured
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    return sampler


def _requests(count: int, adapters: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    # Prompts of 30..100 tokens and 40 new ones: rows cross 64-position pages while decoding.
    return [task(f"r{i}", rng.integers(4, 400, 30 + 7 * i).tolist(), n=1 + i % 2,
                 slot=(i % adapters + 1) if adapters else None, max_tokens=40, temperature=1.0,
                 top_p=0.9 if i % 3 == 1 else 1.0, top_k=20 if i % 3 == 2 else 0, seed=i, stop=[])
            for i in range(count)]


@pytest.fixture(params=[("qwen3", "rows", False, 0), ("qwen3", "paged", True, 3), ("qwen3_moe", "paged", True, 2),
                        ("qwen3_5", "rows", True, 2), ("gpt_oss", "paged", False, 1)],
                ids=lambda p: "-".join(map(str, p)))
def case(request, model_dirs, qwen3_moe_dir, qwen3_5_dir, gpt_oss_dir, monkeypatch):
    family, layout, static, adapters = request.param
    # MoE layers take the grouped matmul, as in bf16 on a GPU (the CPU's loop over experts reads counts).
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    model_dir = {"qwen3_moe": qwen3_moe_dir, "qwen3_5": qwen3_5_dir, "gpt_oss": gpt_oss_dir}.get(family) \
        or model_dirs[family]
    return model_dir, layout, static, adapters


def test_a_decode_burst_reads_back_once_and_copies_nothing(case):
    model_dir, layout, static, adapters = case
    sampler = _sampler(model_dir, layout, static, adapters)
    for t in _requests(6, adapters):
        sampler.add(t)
    with torch.inference_mode():
        sampler._admit([])
        sampler._decode_step([])  # the batch's device tensors are made once per set of rows
        rows = len(sampler.rows)
        with HostSyncs() as h:
            for _ in range(BURSTS):
                sampler._decode_step([])
    assert len(sampler.rows) == rows, "no row finished: the same batch throughout"
    assert h.count("copy") == 0, h.by_site()
    # The burst's tokens and their logprobs, one read each (no row asks for top-k logprobs).
    assert h.count("read") == 2 * BURSTS, h.by_site()
    if layout == "paged":
        assert sampler.cache.pages > 0


def test_rows_that_finish_leave_without_a_read(case):
    """Rows of different max_tokens finish in different bursts; each leaves the batch (the last row
    moving into its place, K/V and length) without reading the device, and every row samples
    what it samples alone."""
    model_dir, layout, static, adapters = case
    rng = np.random.default_rng(5)
    tasks = [task(f"f{i}", rng.integers(4, 400, 20 + 9 * i).tolist(), slot=(i % adapters + 1) if adapters else None,
                  max_tokens=3 + 5 * i, temperature=1.0, seed=i, stop=[]) for i in range(5)]
    sampler = _sampler(model_dir, layout, static, adapters)
    for t in tasks:
        sampler.add(t)
    first: list = []
    with torch.inference_mode():
        sampler._admit(first)
        sampler._decode_step(first)  # the batch's device tensors are made once per set of rows
        results = dict(first)
        while sampler.rows:
            done: list = []
            with HostSyncs() as h:
                sampler._decode_step(done)
            results.update(done)
            # The burst's tokens and logprobs only, however many rows left in it.
            assert h.count("read") == 2 and h.count("copy") == 0, h.by_site()
    assert set(results) == {t.key for t in tasks}
    for t in tasks:  # alone: nothing ever moves into its row
        alone = _sampler(model_dir, layout, static, adapters)
        with torch.inference_mode():
            (key, want), = run(alone, [t]).items()
        np.testing.assert_array_equal(results[key].sequences[0].tokens, want.sequences[0].tokens, err_msg=key)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_top_k_sample_logprobs_are_read_back_once_per_burst(model_dirs, static):
    """Rows asking for top-k sample logprobs add one read of every step's best ids and one of
    their logprobs per burst, not two per step; each row still gets its own k, as the results of
    a sampler decoding one step per burst."""
    from tests.sampling.conftest import run

    def requests():
        rng = np.random.default_rng(5)
        return [task(f"r{i}", rng.integers(4, 400, 20 + 5 * i).tolist(), max_tokens=40, temperature=1.0,
                     seed=i, stop=[], topk_sample_logprobs=(0, 2, 5)[i % 3]) for i in range(5)]

    sampler = _sampler(model_dirs["qwen3"], "paged", static, 0)
    for t in requests():
        sampler.add(t)
    with torch.inference_mode():
        sampler._admit([])
        sampler._decode_step([])
        with HostSyncs() as h:
            for _ in range(BURSTS):
                sampler._decode_step([])
    assert h.count("copy") == 0, h.by_site()
    assert h.count("read") == 4 * BURSTS, h.by_site()
    one_step = make_sampler(fresh_model(model_dirs["qwen3"]), model_dirs["qwen3"], kv_layout="paged", decode_burst=1)
    reference = run(one_step, requests())
    results = run(_sampler(model_dirs["qwen3"], "paged", static, 0), requests())
    for key, ref in reference.items():
        got, want = results[key].sequences[0], ref.sequences[0]
        assert got.tokens.tolist() == want.tokens.tolist(), key
        if want.topk_token_ids is None:
            assert got.topk_token_ids is None, key
            continue
        assert got.topk_token_ids.shape[1] == (0, 2, 5)[int(key[1:]) % 3], key
        np.testing.assert_array_equal(got.topk_token_ids, want.topk_token_ids, err_msg=key)
        np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, rtol=1e-5, atol=1e-5, err_msg=key)


def test_an_admission_reads_its_first_tokens_back_once_whatever_it_seeds(case):
    model_dir, layout, static, adapters = case
    counts = []
    for n in (2, 7):
        sampler = _sampler(model_dir, layout, static, adapters)
        for t in _requests(n, adapters, seed=n):
            sampler.add(t)
        with torch.inference_mode(), HostSyncs() as h:
            sampler._admit([])
        assert len(sampler.rows) == sum(1 + i % 2 for i in range(n)), "every request admitted, all its samples"
        counts.append(h.by_site())
    assert counts[0] == counts[1], "the waits of an admission grow with its requests"
    assert sum(counts[1].values()) <= 2, counts[1]
