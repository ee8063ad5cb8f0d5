"""The paged K/V cache (the layout on GPUs) samples exactly what the per-row cache samples, holds
only the pages its rows use, gives them back, and admits more rows of mixed lengths under one
budget. On a CPU its torch path gathers each row's pages; the decode kernels that read them in
place are checked in tests/sampling/test_decode_kernels.py (interpreted) and tests/gpu."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch

from tests.sampling.conftest import decoder, fresh_model, random_adapter, run, task, three_rows_in_a_bucket_of_four
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.sampling.paged_kv_cache import PAGE, SCRATCH, PagedKVCache
from tinsmith.sampling.sampler import Sampler


def _tasks(vocab: int):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, vocab, n).tolist() for n in (5, 130, 9, 70, 200, 3, 64)]
    return [
        task("short-seeded", prompts[0], n=3, max_tokens=40, temperature=1.0, seed=1, stop=[]),
        task("long-greedy", prompts[1], max_tokens=90, temperature=0.0, stop=[]),
        task("adapter", prompts[2], slot=1, n=2, max_tokens=17, temperature=0.8, top_p=0.9, seed=3, stop=[]),
        task("adapter-top-k", prompts[3], slot=2, max_tokens=70, temperature=1.0, top_k=20, seed=4, stop=[],
             topk_sample_logprobs=2),
        task("longest", prompts[4], slot=1, max_tokens=60, temperature=1.0, seed=5, stop=[], prompt_logprobs=True),
        task("late", prompts[5], max_tokens=12, temperature=0.0, stop=[]),
        task("page-sized", prompts[6], n=2, max_tokens=65, temperature=0.7, seed=6, stop=[]),
    ]


def _sample(model_dir, layout: str, static: bool = False, **kw):
    model = fresh_model(model_dir)
    for slot, rank in ((1, 4), (2, 8)):
        random_adapter(model, slot, rank=rank, seed=slot)
    # max_rows 6 of 11 rows: the last requests wait, then join as others leave (rows move).
    sampler = Sampler(model, decoder(model_dir), max_rows=6, decode_burst=3, kv_layout=layout, **kw)
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    return run(sampler, _tasks(model.config.vocab_size)), sampler


def _watch_rows(sampler: Sampler, budget: int) -> dict:
    """Before each decode step: the most rows decoding at once so far (``peak``), and the cache's
    buffers checked to stay within ``budget``."""
    watch = {"peak": 0}
    step = sampler._decode_step

    def watched(done):
        watch["peak"] = max(watch["peak"], len(sampler.rows))
        assert sampler.cache.nbytes() <= budget
        step(done)

    sampler._decode_step = watched
    return watch


def _assert_same(ref: dict, got: dict) -> None:
    for key, res in ref.items():
        assert not isinstance(res, Exception), res
        for a, b in zip(res.sequences, got[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5, err_msg=key)
            if a.topk_logprobs is not None:
                np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_pages_sample_what_rows_sample(family, static, request):
    """Dense, sliding-window (rings beside pages) and hybrid models; eager and fixed-shape steps;
    prompts and generations across page boundaries; rows joining, finishing and moving."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    ref, rows = _sample(model_dir, "rows", static)
    got, paged = _sample(model_dir, "paged", static)
    assert isinstance(paged.cache, PagedKVCache) and not isinstance(rows.cache, PagedKVCache)
    _assert_same(ref, got)
    if static:
        assert paged.stats["static_steps"] > 0
    _assert_only_the_prefix_cache_holds_pages(paged)  # every page given back, but those it keeps


def test_chunked_prefill_and_prefix_cache_over_pages(qwen3_dir):
    """A long prompt prefilled in chunks, then sent again (its blocks from the prefix cache)."""
    rng = np.random.default_rng(9)
    long_prompt = rng.integers(4, 500, 300).tolist()
    results = []
    for layout in ("rows", "paged"):
        sampler = Sampler(fresh_model(qwen3_dir), decoder(qwen3_dir), prefill_chunk_tokens=100, kv_layout=layout)
        first = run(sampler, [task("a", long_prompt, max_tokens=20, temperature=1.0, seed=1, stop=[])])
        again = run(sampler, [task("b", long_prompt + [7, 8], max_tokens=20, temperature=1.0, seed=2, stop=[])])
        assert sampler.stats["prefill_chunks"] > 0 and sampler.stats["cached_prompt_tokens"] > 0
        results.append({**first, **again})
    _assert_same(*results)


def test_rows_hold_their_own_pages_and_moves_copy_none(qwen3_dir):
    model = fresh_model(qwen3_dir)
    sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged")
    sampler.add(task("long", list(range(4, 4 + 3 * PAGE)), max_tokens=40, temperature=0.0, stop=[]))
    sampler.add(task("short", [5, 6, 7], max_tokens=3, temperature=0.0, stop=[]))
    # (a beginning not shared with "long": a shared one would wait for the next admission)
    sampler.add(task("mid", list(range(300, 300 + PAGE + 1)), max_tokens=30, temperature=0.0, stop=[]))
    cache = sampler.cache
    with torch.inference_mode():
        sampler._admit([])
    # Each row holds the pages of its own prompt (and the first sampled token's room), not the longest row's.
    held = {row.state.task.key: len(cache.owned[r]) for r, row in enumerate(sampler.rows)}
    assert held == {"long": 3, "short": 1, "mid": 2}
    mid_pages = list(cache.owned[2])
    while "short" in [row.state.task.key for row in sampler.rows]:
        sampler.step(0.01)
    # "short" (row 1) finished: "mid", the last row, took its place with its own pages, nothing copied.
    assert [row.state.task.key for row in sampler.rows] == ["long", "mid"]
    assert cache.owned[1] == mid_pages and cache.table[1, :2].tolist() == mid_pages and not cache.owned[2]
    assert cache.table[2].eq(0).all()


def test_mixed_lengths_admit_more_rows_under_one_budget(qwen3_dir):
    """One long request among short ones: per-row buffers count every row at the longest row's
    length, pages count each row at its own. Same budget, same results, more rows at once."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    budget = 12 * 2 * PAGE * per_position  # 12 rows of 128 positions
    rng = np.random.default_rng(3)
    make = lambda: ([task("long", rng.integers(4, 500, 400).tolist(), max_tokens=40, temperature=0.0, stop=[])]  # noqa: E731
                    + [task(f"s{i}", rng.integers(4, 500, 20).tolist(), max_tokens=40, temperature=0.0, stop=[])
                       for i in range(10)])
    peaks, results = {}, {}
    for layout in ("rows", "paged"):
        sampler = Sampler(model, decoder(qwen3_dir), kv_cache_bytes=budget, prefix_cache_bytes=0, kv_layout=layout)
        watch = _watch_rows(sampler, budget)
        rng = np.random.default_rng(3)
        results[layout] = run(sampler, make())
        peaks[layout] = watch["peak"]
    _assert_same(results["rows"], results["paged"])
    assert peaks["paged"] == 11 and peaks["rows"] < 11, peaks  # every request at once only in pages


def test_padding_rows_of_a_fixed_step_leave_every_page_untouched(qwen3_dir):
    """3 live rows in a bucket of 4: the padding row (a free row, pointing at the scratch page)
    writes there; every page no live row writes is bit for bit as before."""
    sampler = three_rows_in_a_bucket_of_four(qwen3_dir, kv_layout="paged")
    done: list = []
    with torch.inference_mode():
        cache = sampler.cache
        cache.reserve([8, 8, 8])
        live = {p for pages in cache.owned for p in pages}
        assert SCRATCH not in live and cache.table[3].eq(SCRATCH).all()
        idle = [p for p in range(cache.pages) if p not in live and p != SCRATCH]
        for pool in cache.K + cache.V:
            pool[idle] = torch.randn_like(pool[idle])  # pages no row owns
        before = [pool[idle].clone() for pool in cache.K + cache.V]
        sampler._decode_step(done)
    assert sampler.stats["static_steps"] == 2 and cache.lengths[:3].tolist() == [6, 6, 6]
    for old, pool in zip(before, cache.K + cache.V):
        assert torch.equal(old, pool[idle])


def test_the_pool_grows_keeping_pages_and_shrinks_when_idle(qwen3_dir):
    cfg = fresh_model(qwen3_dir).config
    cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=2)
    table = cache.table.data_ptr()
    k = torch.randn(cfg.num_kv_heads, 3 * PAGE, cfg.head_dim)
    cache.write_prefix(range(1), {0: (k, -k), 1: (2 * k, k)}, 3 * PAGE)
    cache.ensure(2, 8 * PAGE)
    cache.reserve([8 * PAGE, 7 * PAGE])  # more pages than the pool holds: it grows
    assert cache.pages >= 15 and cache.table.data_ptr() == table  # the table never moves
    K, V = cache._rows_view(0, 1, 3 * PAGE, {})
    assert torch.equal(K[0], k) and torch.equal(V[0], -k)  # written pages kept their contents
    cache.keep_rows(2, [])  # both rows leave
    assert not any(cache.owned)
    cache.shrink(0, 1)
    assert cache.pages == cache._initial_pages and sorted(cache.free) == list(range(1, cache.pages))


@pytest.mark.parametrize("length,held", [(3 * PAGE + 5, 0), (3 * PAGE + 5, 2), (2 * PAGE, 1), (7, 0)])
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_rows_of_a_prompt_written_at_once_hold_what_rows_written_one_by_one_hold(family, length, held, qwen3_dir,
                                                                                 gpt_oss_dir):
    """Every row of a prompt is written by one store per layer: the rows share its full pages
    (``held`` of them the prefix cache's, the rest the first row's), each owns its partial last
    page, and each reads the prompt's K/V, as rows written one at a time. gpt-oss keeps its
    sliding-window layers beside the pages, in per-row rings."""
    cfg = fresh_model(qwen3_dir if family == "qwen3" else gpt_oss_dir).config
    g = torch.Generator().manual_seed(5)
    kv = {i: (torch.randn(cfg.num_kv_heads, length + 3, cfg.head_dim, generator=g),
              torch.randn(cfg.num_kv_heads, length + 3, cfg.head_dim, generator=g)) for i in range(cfg.num_layers)}
    caches = []
    for at_once in (True, False):
        cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=5)
        cache.ensure(5, length + 8)
        shared = cache.write_prefix(range(4, 5), kv, length)[:held]  # as the prefix cache's pages
        if at_once:
            cache.write_prefix(range(0, 3), kv, length, shared=shared)
        else:
            for r in range(3):
                written = cache.write_prefix(range(r, r + 1), kv, length, shared=shared)
                shared = written if len(written) > len(shared) else shared
        caches.append(cache)
    together, alone = caches
    full = length // PAGE
    assert together.owned == alone.owned and together.refs == alone.refs
    assert all(together.owned[r][:full] == together.owned[4][:held] + together.owned[0][held:full] for r in range(3))
    if length % PAGE:  # each its own partial last page
        assert len({together.owned[r][full] for r in range(3)}) == 3 and all(len(together.owned[r]) == full + 1
                                                                               for r in range(3))
    assert together.lengths[:3].tolist() == [length] * 3
    for layer in range(cfg.num_layers):
        for cache in caches:
            K, V = cache._rows_view(layer, 3, length, {})
            want_k, want_v = kv[layer][0][:, :length], kv[layer][1][:, :length]
            if cache.rings[layer] is not None and length > cache.rings[layer]:
                continue  # a ring holds the last positions in its own order: compared between the two below
            assert all(torch.equal(K[r], want_k) and torch.equal(V[r], want_v) for r in range(3)), layer
        if not together.paged[layer]:
            assert torch.equal(together.K[layer][:3], alone.K[layer][:3])


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_rows_leaving_together_leave_the_cache_as_rows_leaving_one_by_one(family, layout, qwen3_dir, gpt_oss_dir):
    """Rows that finish in the same burst leave in one step of the cache (one gather and store
    per buffer): the rows kept, their K/V, lengths, page tables and page references are what
    the rows leaving one at a time, the last row taking each place, leave."""
    from tinsmith.sampling.kv_cache import RowKVCache

    cfg = fresh_model(qwen3_dir if family == "qwen3" else gpt_oss_dir).config
    g = torch.Generator().manual_seed(9)
    lengths = [3 * PAGE + 5, 70, 2 * PAGE, 9, 150, 4 * PAGE - 1, 33]
    make = PagedKVCache if layout == "paged" else RowKVCache
    caches = []
    for together in (True, False):
        cache = make(cfg, torch.device("cpu"), torch.float32, rows=len(lengths))
        cache.ensure(len(lengths), 4 * PAGE)
        g.manual_seed(9)
        for r, n in enumerate(lengths):
            kv = {i: (torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=g),) * 2 for i in range(cfg.num_layers)}
            cache.write_prefix(range(r, r + 1), kv, n)
        leaving = [1, 2, 6]
        if together:
            order = list(range(len(lengths)))
            for r in sorted(leaving, reverse=True):
                order[r] = order[-1]
                order.pop()
            assert order == [0, 4, 5, 3]
            cache.keep_rows(len(lengths), order, max(lengths))
        else:
            rows = len(lengths)
            for r in sorted(leaving, reverse=True):
                rows -= 1
                cache.keep_rows(rows + 1, list(range(rows)) if r == rows else [*range(r), rows, *range(r + 1, rows)],
                                max(lengths))
        caches.append(cache)
    a, b = caches
    assert a.lengths[:4].tolist() == b.lengths[:4].tolist() == [lengths[i] for i in (0, 4, 5, 3)]
    for layer in range(cfg.num_layers):
        for x, y in zip(a._rows_view(layer, 4, 4 * PAGE, {}), b._rows_view(layer, 4, 4 * PAGE, {})):
            for r, n in enumerate(a.lengths[:4].tolist()):
                assert torch.equal(x[r, :, :n], y[r, :, :n]), (layer, r)
    if layout == "paged":
        assert a.owned == b.owned and a.refs == b.refs and sorted(a.free) == sorted(b.free)
        assert torch.equal(a.table, b.table) and a.table[4:].eq(SCRATCH).all()


@pytest.mark.parametrize("prompt_len", [200, 2 * PAGE], ids=["partial-last-page", "whole-pages"])
def test_rows_of_one_prompt_share_its_full_pages(qwen3_dir, prompt_len):
    """num_samples rows, and separate requests of the same prompt admitted together, hold one copy
    of the prompt's full pages (each its own last, partial page); results are the per-row
    layout's, and every page comes back once all rows are done."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(4, 500, prompt_len).tolist()
    make = lambda: [task("grpo", prompt, n=6, max_tokens=30, temperature=1.0, seed=1, stop=[]),  # noqa: E731
                    task("again", prompt, n=2, max_tokens=30, temperature=1.0, seed=2, stop=[]),
                    task("other", rng.integers(4, 500, 70).tolist(), max_tokens=30, temperature=1.0, seed=3, stop=[])]
    results = {}
    for layout in ("rows", "paged"):
        sampler = Sampler(fresh_model(qwen3_dir), decoder(qwen3_dir), kv_layout=layout)
        rng = np.random.default_rng(4)
        prompt = rng.integers(4, 500, prompt_len).tolist()
        for t in make():
            sampler.add(t)
        admitted: list = []
        with torch.inference_mode():
            sampler._admit(admitted)
        if layout == "paged":
            cache = sampler.cache
            full = prompt_len // PAGE
            prompt_rows = [r for r, row in enumerate(sampler.rows) if row.state.task.key in ("grpo", "again")]
            first = cache.owned[prompt_rows[0]][:full]
            for r in prompt_rows:
                assert cache.owned[r][:full] == first  # one copy of the full pages
            assert all(cache.refs[p] == len(prompt_rows) + 1 for p in first)  # and the prefix cache
            tails = [cache.owned[r][full:] for r in prompt_rows]
            assert len({p for t in tails for p in t}) == sum(len(t) for t in tails)  # own last pages
            in_use = {p for pages in cache.owned for p in pages}
            other = next(r for r, row in enumerate(sampler.rows) if row.state.task.key == "other")
            assert len(in_use) == full + sum(len(t) for t in tails) + len(cache.owned[other])
            assert cache.used_bytes(len(sampler.rows)) == len(in_use) * cache.page_bytes()  # what /metrics shows
        results[layout] = {**dict(admitted), **run(sampler, [])}
        if layout == "paged":
            assert _prefix_pages(sampler)[:full] == first  # and "other"'s full page
            _assert_only_the_prefix_cache_holds_pages(sampler)
    assert set(results["rows"]) == {"grpo", "again", "other"}
    _assert_same(results["rows"], results["paged"])


def test_a_shared_prompt_is_counted_once_by_admission(qwen3_dir):
    """GRPO's groups: 2 prompts of 4 pages, 8 samples each. Counted once per group, both groups
    fit a budget that holds each prompt once plus every row's own pages; counted per row, or
    every row at the longest, they do not, and requests wait for each other. Same results."""
    model = fresh_model(qwen3_dir)
    cache = PagedKVCache(model.config, torch.device("cpu"), torch.float32)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(4, 500, 4 * PAGE).tolist() for _ in range(2)]
    budget = (2 * 4 + 16 * 2) * cache.page_bytes()  # each prompt once, each row a tail page and room
    make = lambda: [task(f"g{i}", p, n=8, max_tokens=20, temperature=1.0, seed=i, stop=[])  # noqa: E731
                    for i, p in enumerate(prompts)]
    peaks, results = {}, {}
    for layout in ("rows", "paged"):
        sampler = Sampler(model, decoder(qwen3_dir), kv_cache_bytes=budget, prefix_cache_bytes=0, kv_layout=layout)
        watch = _watch_rows(sampler, budget)
        results[layout] = run(sampler, make())
        peaks[layout] = watch["peak"]
    _assert_same(results["rows"], results["paged"])
    assert peaks == {"rows": 8, "paged": 16}, peaks


def test_a_padding_row_never_overwrites_a_live_write(qwen3_dir):
    """A page a row let go of is the next one taken, possibly written this very step by a live row,
    while a free row's table points at the scratch page: padding rows write there, never on a page
    a row holds."""
    cfg = fresh_model(qwen3_dir).config
    cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=4)
    kv = lambda n: {0: (torch.randn(cfg.num_kv_heads, n, cfg.head_dim),) * 2,  # noqa: E731
                    1: (torch.randn(cfg.num_kv_heads, n, cfg.head_dim),) * 2}
    cache.write_prefix(range(0, 1), kv(PAGE), PAGE)  # row 0 takes page 1 (page 0 is scratch)
    cache.write_prefix(range(1, 2), kv(PAGE), PAGE)  # row 1 takes page 2
    cache.keep_rows(2, [1])  # row 0 leaves (page 1 is free again); row 1 becomes row 0
    cache.reserve([PAGE + 1])  # row 0's second page: page 1
    assert cache.owned[0] == [2, 1] and cache.table[1].eq(SCRATCH).all()
    before = cache.K[0][2].clone()
    attend = cache.decode_attention(2, PAGE + 1, live=torch.tensor([1, 0]))
    q = torch.randn(2, cfg.num_heads, 1, cfg.head_dim)
    k, v = torch.randn(2, cfg.num_kv_heads, 1, cfg.head_dim), torch.randn(2, cfg.num_kv_heads, 1, cfg.head_dim)
    attend(0, q, k, v)
    assert torch.equal(cache.K[0][1, :, 0], k[0, :, 0])  # row 0's position 64: page 1, slot 0
    assert torch.equal(cache.K[0][2], before)  # row 0's first page: untouched
    assert torch.equal(cache.K[0][SCRATCH, :, 0], k[1, :, 0])  # the padding row's write landed on scratch


def test_growing_batches_move_nothing_a_captured_step_reads(qwen3_dir):
    """A dense model's paged cache: more rows and longer spans leave every address a CUDA graph
    holds where it was (the table and lengths are made for the sampler's most rows); per-row
    buffers move at each growth. Only a pool that must grow moves its pages."""
    cfg = fresh_model(qwen3_dir).config
    paged = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=2, table_rows=64)
    rows = Sampler(fresh_model(qwen3_dir), decoder(qwen3_dir), kv_layout="rows").cache
    before = (paged.addresses(), rows.addresses())
    for cache in (paged, rows):
        cache.ensure(40, 4 * PAGE)
    assert paged.addresses() == before[0] and rows.addresses() != before[1]
    paged.reserve([4 * PAGE] * 40)  # 160 pages: the pool grows
    assert paged.addresses() != before[0]


def _prefix_pages(sampler: Sampler) -> list[int]:
    """The pages the prefix cache holds, in the order its blocks were made (a chain's first first)."""
    return [e.page for e in sorted(sampler.prefix.entries.values(), key=lambda e: e.id)]


def _assert_only_the_prefix_cache_holds_pages(sampler: Sampler) -> None:
    cache, kept = sampler.cache, _prefix_pages(sampler)
    assert not any(cache.owned)
    assert [cache.refs[p] for p in range(cache.pages)] == [int(p in kept or p == SCRATCH) for p in range(cache.pages)]
    assert sorted(cache.free + kept + [SCRATCH]) == list(range(cache.pages))


def test_prefix_cache_blocks_are_pool_pages(qwen3_dir):
    """Prompts sent again in a later admission (GRPO as separate requests, a longer turn, a prompt
    of whole pages) hold the prefix cache's pages themselves: no K/V copied into new pages, one
    copy in the pool. Results equal a sampler without a prefix cache; afterwards the cache alone
    holds its pages."""
    model = fresh_model(qwen3_dir)
    rng = np.random.default_rng(12)
    prompt = rng.integers(4, 500, 3 * PAGE + 10).tolist()
    turn = prompt + rng.integers(4, 500, 80).tolist()
    exact = prompt[: 2 * PAGE]  # whole pages: the cache holds its last token's K/V too
    first = lambda: [task("first", prompt, max_tokens=20, temperature=1.0, seed=1, stop=[])]  # noqa: E731
    later = lambda: [task("again", prompt, n=3, max_tokens=20, temperature=1.0, seed=2, stop=[]),  # noqa: E731
                     task("turn", turn, max_tokens=20, temperature=0.0, stop=[]),
                     task("exact", exact, n=2, max_tokens=70, temperature=1.0, seed=3, stop=[])]
    plain = Sampler(model, decoder(qwen3_dir), kv_layout="paged", prefix_cache_bytes=0)
    want = {**run(plain, first()), **run(plain, later())}
    sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged")
    got = run(sampler, first())
    cache = sampler.cache
    _assert_only_the_prefix_cache_holds_pages(sampler)
    blocks = _prefix_pages(sampler)
    assert len(blocks) == 3
    computed = sampler.stats["prefill_tokens"]
    for t in later():
        sampler.add(t)
    admitted: list = []
    with torch.inference_mode():
        sampler._admit(admitted)
    # Only what the cache lacks: nothing of "again" (the tail and last logits of its prompt were
    # kept beside the blocks), the longer turn's new tokens, the last token of "exact".
    assert sampler.stats["prefill_tokens"] - computed == (10 + 80) + 1
    rows = {key: [r for r, row in enumerate(sampler.rows) if row.state.task.key == key] for key in ("again", "turn", "exact")}
    for r in rows["again"] + rows["turn"]:
        assert cache.owned[r][:3] == blocks[:3]  # the cache's pages, read in place
    for r in rows["exact"]:
        assert cache.owned[r][:2] == blocks[:2]
    holders = [len(rows["again"]) + len(rows["turn"]) + len(rows["exact"])] * 2 + [len(rows["again"]) + len(rows["turn"])]
    assert [cache.refs[p] for p in blocks[:3]] == [1 + h for h in holders]
    assert len(_prefix_pages(sampler)) == 3 + 1  # the longer turn's fourth full page joined the cache
    got.update(dict(admitted))
    got.update(run(sampler, []))
    _assert_same(want, got)
    _assert_only_the_prefix_cache_holds_pages(sampler)


def test_a_full_pool_evicts_cached_pages_before_it_grows(qwen3_dir):
    """Under a K/V budget of 8 pages, prompts of different 2-page prefixes fill the prefix cache
    until the pool is full: then the least recently used cached pages make room, the pool never
    outgrows the budget, and results stay those of a sampler without a prefix cache."""
    model = fresh_model(qwen3_dir)
    page_bytes = PagedKVCache(model.config, torch.device("cpu"), torch.float32).page_bytes()
    budget = 8 * page_bytes
    rng = np.random.default_rng(21)
    prompts = [rng.integers(4, 500, 2 * PAGE + 5).tolist() for _ in range(6)]
    order = [0, 1, 2, 3, 4, 5, 5, 0]  # the last two: a hit, then a prompt evicted meanwhile
    make = lambda i, j: task(f"p{j}", prompts[i], max_tokens=30, temperature=1.0, seed=j, stop=[])  # noqa: E731
    plain = Sampler(model, decoder(qwen3_dir), kv_layout="paged", kv_cache_bytes=budget, prefix_cache_bytes=0)
    sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged", kv_cache_bytes=budget)
    for j, i in enumerate(order):
        want = run(plain, [make(i, j)])
        got = run(sampler, [make(i, j)])
        _assert_same(want, got)
        assert sampler.cache.pages <= 8 + 1  # the budget's pages, and the scratch page beside them
        hit = got[f"p{j}"].prompt_cache_hit_tokens
        assert hit == (len(prompts[i]) if j == 6 else 0), (j, hit)  # 7: a kept tail whose blocks were evicted
    assert sampler.prefix.stats["evicted_blocks"] > 0
    _assert_only_the_prefix_cache_holds_pages(sampler)


def test_an_idle_pool_shrinks_keeping_the_cached_pages(qwen3_dir):
    """After a busy spell the idle pool is reallocated small; the prefix cache's pages move to its
    first ids with their K/V, and a later hit reads them there."""
    model = fresh_model(qwen3_dir)
    rng = np.random.default_rng(30)
    prompt = rng.integers(4, 500, 2 * PAGE + 3).tolist()
    busy = [task(f"busy{i}", rng.integers(4, 500, 3 * PAGE).tolist(), n=8, max_tokens=130, temperature=1.0, seed=i,
                 stop=[]) for i in range(3)]
    plain = Sampler(model, decoder(qwen3_dir), kv_layout="paged", prefix_cache_bytes=0)
    sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged")
    last = lambda: [task("again", prompt, max_tokens=30, temperature=1.0, seed=9, stop=[])]  # noqa: E731
    run(sampler, [task("first", prompt, max_tokens=5, temperature=0.0, stop=[])] + busy)
    cache = sampler.cache
    kept = len(_prefix_pages(sampler))
    assert cache.pages == max(cache._initial_pages, kept + 1)  # the scratch page keeps id 0
    assert sorted(_prefix_pages(sampler)) == list(range(1, kept + 1))
    _assert_only_the_prefix_cache_holds_pages(sampler)
    got = run(sampler, last())
    assert got["again"].prompt_cache_hit_tokens == len(prompt)  # the pages, and the tail kept beside them
    _assert_same(run(plain, last()), got)


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_an_idle_sampler_keeps_its_cache_until_asked_to_give_it_back(qwen3_dir, layout):
    """``keep_cache_when_idle`` (the worker's choice on GPUs): after a busy spell the K/V buffers
    stay where they are, so the next burst reallocates nothing (and CUDA graphs over them stay
    valid). ``release_memory`` gives them back with the prefix cache; a busy sampler gives nothing."""
    model = fresh_model(qwen3_dir)
    rng = np.random.default_rng(40)
    busy = [task(f"busy{i}", rng.integers(4, 500, 3 * PAGE).tolist(), n=8, max_tokens=130, temperature=1.0,
                 seed=i, stop=[]) for i in range(3)]
    later = lambda: [task("later", rng.integers(4, 500, 70).tolist(), n=2, max_tokens=40, temperature=1.0,  # noqa: E731
                          seed=7, stop=[])]
    keeping = Sampler(model, decoder(qwen3_dir), kv_layout=layout, keep_cache_when_idle=True)
    giving = Sampler(model, decoder(qwen3_dir), kv_layout=layout)
    run(keeping, busy)
    run(giving, busy)
    assert giving.cache.nbytes() < keeping.cache.nbytes() // 4  # the default gives it back when idle
    addresses, kept = keeping.cache.addresses(), keeping.cache.nbytes()
    rng = np.random.default_rng(41)
    got = run(keeping, later())
    assert keeping.cache.addresses() == addresses  # the next burst reallocated nothing
    keeping.add(later()[0])
    assert keeping.release_memory() == 0 and keeping.cache.addresses() == addresses  # busy: nothing given back
    run(keeping, [])
    assert len(keeping.prefix) > 0
    released = keeping.release_memory()
    assert released >= kept - keeping.cache.nbytes() > kept // 2 and len(keeping.prefix) == 0
    rng = np.random.default_rng(41)
    _assert_same(run(giving, later()), got)


def test_a_prefill_out_of_memory_has_other_idle_samplers_give_theirs_back(qwen3_dir):
    """Sampler b's prefill runs out of device memory while idle sampler a keeps its K/V buffers:
    a gives them back (``release_elsewhere``, as the worker wires it), and b's prefill runs again
    and gives b's results; when nothing is left to give back, the request fails as before."""
    model = fresh_model(qwen3_dir)
    rng = np.random.default_rng(50)
    a = Sampler(model, decoder(qwen3_dir), kv_layout="paged", keep_cache_when_idle=True, prefix_cache_bytes=0)
    b = Sampler(model, decoder(qwen3_dir), kv_layout="paged", prefix_cache_bytes=0)
    run(a, [task("a", rng.integers(4, 500, 3 * PAGE).tolist(), n=16, max_tokens=130, temperature=1.0, seed=1,
                 stop=[])])
    kept = a.cache.nbytes()
    b.release_elsewhere = a.release_memory
    prompt = rng.integers(4, 500, 40).tolist()
    want = run(Sampler(model, decoder(qwen3_dir), kv_layout="paged"), [task("b", prompt, max_tokens=9, seed=2)])
    real, failures = b._forward_prompts, [1]

    def forward_prompts(states):
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(states)

    b._forward_prompts = forward_prompts
    got = run(b, [task("b", prompt, max_tokens=9, seed=2)])
    _assert_same(want, got)
    assert a.cache.nbytes() < kept // 4
    failures[0] = 1
    assert isinstance(run(b, [task("again", prompt, max_tokens=9, seed=2)])["again"], torch.OutOfMemoryError)


def test_a_burst_grows_the_pool_once(qwen3_dir, monkeypatch):
    """Rows that together lack many pages grow the pool in one reallocation (each copies the pool
    and makes captured graphs recapture), not by doubling again and again."""
    cfg = fresh_model(qwen3_dir).config
    cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=2)
    resizes: list[int] = []
    real = cache._resize_pool
    monkeypatch.setattr(cache, "_resize_pool", lambda pages, keep=None: (resizes.append(pages), real(pages, keep)))
    cache.ensure(8, 5 * PAGE)
    cache.reserve([5 * PAGE] * 8)
    assert len(resizes) == 1 and cache.pages >= 40 and len({p for pages in cache.owned for p in pages}) == 40


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_a_cache_that_cannot_grow_has_idle_samplers_give_memory_back(qwen3_dir, layout):
    """The K/V cache runs out of device memory growing for a decode burst while idle sampler a
    keeps its buffers: a gives them back and the burst goes on, the requests sampling what they
    would have; with nothing to give back, the burst's requests fail as before."""
    model = fresh_model(qwen3_dir)
    rng = np.random.default_rng(60)
    a = Sampler(model, decoder(qwen3_dir), kv_layout=layout, keep_cache_when_idle=True, prefix_cache_bytes=0)
    b = Sampler(model, decoder(qwen3_dir), kv_layout=layout, prefix_cache_bytes=0)
    run(a, [task("a", rng.integers(4, 500, 3 * PAGE).tolist(), n=16, max_tokens=130, temperature=1.0, seed=1,
                 stop=[])])
    kept = a.cache.nbytes()
    b.release_elsewhere = a.release_memory
    make = lambda key: [task(key, rng.integers(4, 500, 60).tolist(), n=3, max_tokens=90, temperature=1.0,  # noqa: E731
                             seed=2, stop=[])]
    rng = np.random.default_rng(61)
    want = run(Sampler(model, decoder(qwen3_dir), kv_layout=layout), make("b"))
    grow, failures = b.cache.reserve, [1]

    def reserve(spans):
        if failures[0] and max(spans) > 64:  # growing past the first block / page
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return grow(spans)

    b.cache.reserve = reserve
    rng = np.random.default_rng(61)
    _assert_same(want, run(b, make("b")))
    assert failures == [0] and a.cache.nbytes() < kept // 4
    failures[0] = 1
    assert isinstance(run(b, make("again"))["again"], torch.OutOfMemoryError)


def test_admission_counts_a_cached_beginning_held_by_running_rows_once(qwen3_dir):
    """Prompts behind one system prompt whose pages a running row and the prefix cache hold:
    each new request is counted at its own pages only, so under a budget that holds the running
    row and the others' own pages, all of them are admitted together (counting each one's whole
    prompt, only one would be). Results equal a sampler without a budget."""
    rng = np.random.default_rng(12)
    system = rng.integers(4, 500, 4 * PAGE).tolist()
    first = task("first", system + rng.integers(4, 500, 10).tolist(), max_tokens=120, temperature=1.0, seed=1, stop=[])
    later = [task(f"q{i}", system + rng.integers(4, 500, 10).tolist(), max_tokens=20, temperature=1.0, seed=2 + i,
                  stop=[]) for i in range(3)]
    model = fresh_model(qwen3_dir)
    want = run(Sampler(model, decoder(qwen3_dir), kv_layout="paged"), [first, *later])

    probe = Sampler(model, decoder(qwen3_dir), kv_layout="paged")
    probe.add(first)
    with torch.inference_mode():
        probe._admit([])
        running = probe.cache.tally(probe._occupancy()).bytes()
        need = probe._prompt_need(later[0], probe._share_key(later[0]), probe._held(later[0].input, 0), "q", False)
    assert need.pages == tuple(probe.cache.owned[0][:4]), "the system prompt's pages, which the first row holds"
    own = -(-need.positions // PAGE) - len(need.pages)
    budget = running + 3 * own * probe.cache.page_bytes()

    sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged", kv_cache_bytes=budget)
    sampler.add(first)
    with torch.inference_mode():
        sampler._admit([])
        for t in later:
            sampler.add(t)
        sampler._admit([])
    assert [row.state.task.key for row in sampler.rows] == ["first", "q0", "q1", "q2"]
    assert sampler.stats["cached_prompt_tokens"] == 3 * len(system)
    got = {}
    while sampler.has_work():
        got.update(sampler.step(0.05))
    _assert_same(want, got)
    assert sampler.stats["preempted"] == 0


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_the_budget_bound_from_positions_alone_is_never_below_the_exact_count(family, qwen3_dir, gpt_oss_dir):
    """The decode loop checks the K/V budget every burst by :meth:`bytes_at_most` (positions only)
    and tallies pages exactly only when that passes the budget: the bound must hold whatever the
    rows share (a prompt's pages, prefix-cache hits), and equal the count when they share nothing."""
    from tinsmith.sampling.kv_cache import RowKVCache, RowNeed

    cfg = fresh_model(qwen3_dir if family == "qwen3" else gpt_oss_dir).config
    cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=4)
    kv = lambda n: {i: (torch.randn(cfg.num_kv_heads, n, cfg.head_dim),) * 2  # noqa: E731
                    for i in range(cfg.num_layers) if cache.paged[i]}
    first = cache.write_prefix(range(0, 1), kv(2 * PAGE + 5), 2 * PAGE + 5)  # two full prompt pages ...
    cache.write_prefix(range(1, 2), kv(2 * PAGE + 5), 2 * PAGE + 5, shared=first)  # ... held by a second row too
    cache.write_prefix(range(2, 3), kv(7), 7)
    positions = [2 * PAGE + 9, 2 * PAGE + 9, 12]
    shared = [RowNeed(p, "prompt", 2 * PAGE + 5, cache.held_pages(r)) for r, p in enumerate(positions[:2])]
    exact = cache.bytes_for(shared + [RowNeed(12, None, 0, cache.held_pages(2))])
    assert cache.bytes_at_most(positions) >= exact
    assert cache.bytes_at_most(positions) == cache.bytes_for(positions)  # nothing shared: the same count
    assert cache.bytes_at_most(positions) - exact == 2 * cache.page_bytes()  # the shared pages, counted twice
    assert cache.static_bytes_at_most(positions, 8, 4 * PAGE) >= cache.static_bytes(shared, 8, 4 * PAGE)
    rows = RowKVCache(cfg, torch.device("cpu"), torch.float32)
    assert rows.bytes_at_most(positions) == rows.bytes_for(positions)  # per-row buffers: exact


def test_an_admission_of_a_kept_prompt_costs_the_same_for_one_request_or_many(qwen3_dir):
    """GRPO's later requests of a prompt already prefilled: their admission runs no forward pass,
    and the device operations it dispatches (each a kernel launch on a GPU, which the decoding rows
    wait for) do not grow with the requests: every row of the prompt is written at once."""
    from bench.dispatch_micro import KernelOps  # operations that run a kernel (not views)

    model = fresh_model(qwen3_dir)
    prompt = np.random.default_rng(8).integers(4, 500, 2 * PAGE + 5).tolist()
    counts = {}
    for n in (4, 16):
        sampler = Sampler(model, decoder(qwen3_dir), kv_layout="paged", max_rows=17)
        sampler.cache.ensure(17, 4 * PAGE)
        sampler.cache._make_free(40)  # no pool growth inside the counted admission
        done: list = []
        with torch.inference_mode():
            sampler.add(task("first", prompt, max_tokens=8, temperature=1.0, seed=0, stop=[]))
            sampler._admit(done)
            for i in range(n):
                sampler.add(task(f"g{i}", prompt, max_tokens=8, temperature=1.0, seed=1 + i, stop=[]))
            prefills, ops = sampler.stats["prefills"], KernelOps()
            with ops:
                sampler._admit(done)
        assert not done and len(sampler.rows) == n + 1 and sampler.stats["prefills"] == prefills
        counts[n] = sum(ops.ops.values())
    assert counts[16] == counts[4], counts  # not a store per row and layer


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_prompts_written_together_hold_what_prompts_written_one_by_one_hold(family, qwen3_dir, gpt_oss_dir):
    """An admission's prompts are stored together (one store per layer for K and V): prompts of
    whole and partial pages, several rows of one prompt, one beginning with the prefix cache's pages,
    each from its own tensor or rows of one prefill's, leave the pages, their holders, the table,
    the lengths and every row's K/V as prompts written one at a time."""
    cfg = fresh_model(qwen3_dir if family == "qwen3" else gpt_oss_dir).config
    g = torch.Generator().manual_seed(7)
    lengths = [3 * PAGE + 5, 2 * PAGE, 7, PAGE + 1]
    width = max(lengths) + 2
    prefill = {i: (torch.randn(len(lengths), cfg.num_kv_heads, width, cfg.head_dim, generator=g),
                   torch.randn(len(lengths), cfg.num_kv_heads, width, cfg.head_dim, generator=g))
               for i in range(cfg.num_layers)}
    own = {i: (torch.randn(cfg.num_kv_heads, 40, cfg.head_dim, generator=g),
               torch.randn(cfg.num_kv_heads, 40, cfg.head_dim, generator=g)) for i in range(cfg.num_layers)}
    # (rows, K/V per layer, length, how many of its full pages the prefix cache holds)
    prompts = [(range(1, 3), {i: (k[0], v[0]) for i, (k, v) in prefill.items()}, lengths[0], 2),
               (range(3, 4), {i: (k[1], v[1]) for i, (k, v) in prefill.items()}, lengths[1], 0),
               (range(4, 7), {i: (k[2], v[2]) for i, (k, v) in prefill.items()}, lengths[2], 0),
               (range(7, 8), own, 37, 0),
               (range(8, 9), {i: (k[3], v[3]) for i, (k, v) in prefill.items()}, lengths[3], 0)]
    caches = []
    for together in (True, False):
        cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=9)
        cache.ensure(9, width + 8)
        cached = cache.write_prefix(range(0, 1), prompts[0][1], lengths[0])[:2]  # as the prefix cache's pages
        with cache.writes_together() if together else nullcontext():
            for rows, kv, length, held in prompts:
                cache.write_prefix(rows, kv, length, shared=cached[:held])
        caches.append(cache)
    together, alone = caches
    assert together.owned == alone.owned and together.refs == alone.refs and together.free == alone.free
    assert torch.equal(together.table, alone.table) and torch.equal(together.lengths, alone.lengths)
    assert together.lengths[1:9].tolist() == [lengths[0]] * 2 + [lengths[1]] + [lengths[2]] * 3 + [37, lengths[3]]
    for layer in range(cfg.num_layers):
        for rows, kv, length, _ in prompts:
            K, V = together._rows_view(layer, rows.stop, length, {})
            if together.rings[layer] is not None and length > together.rings[layer]:
                continue  # a ring holds the last positions in its own order: compared between the two below
            for r in rows:
                assert torch.equal(K[r], kv[layer][0][:, :length]) and torch.equal(V[r], kv[layer][1][:, :length])
        if not together.paged[layer]:
            assert torch.equal(together.K[layer][:9], alone.K[layer][:9])


def test_what_is_written_together_is_stored_only_at_the_end(qwen3_dir):
    """Nothing of a prompt is stored before the end of ``writes_together`` (the sampler reads no row
    before it), and where its block raises, nothing of it is stored at all."""
    cfg = fresh_model(qwen3_dir).config
    kv = {i: (torch.ones(cfg.num_kv_heads, PAGE + 3, cfg.head_dim), torch.ones(cfg.num_kv_heads, PAGE + 3, cfg.head_dim))
          for i in range(cfg.num_layers)}
    cache = PagedKVCache(cfg, torch.device("cpu"), torch.float32, rows=2)
    cache.ensure(2, 2 * PAGE)
    with cache.writes_together():
        cache.write_prefix(range(0, 1), kv, PAGE + 3)
        assert int(cache.lengths[0]) == 0 and not any(bool(K.any()) for K in cache.K)
    assert int(cache.lengths[0]) == PAGE + 3 and all(bool(K[cache.owned[0][0]].all()) for K in cache.K)
    with pytest.raises(RuntimeError, match="refused"):
        with cache.writes_together():
            cache.write_prefix(range(1, 2), kv, PAGE + 3)
            raise RuntimeError("refused")
    assert int(cache.lengths[1]) == 0 and cache._pending is None


def test_an_admission_of_new_prompts_stores_them_in_operations_that_do_not_grow_with_them(qwen3_dir):
    """An admission of new prompts (partial pages, tails kept for the next admission of the same
    prompt) dispatches the same device operations for 4 prompts as for 16 (each a launch on a GPU,
    while decoding rows wait) beyond one copy of each prompt's last logits; rows that end at
    once (one token asked) are retired after every prompt is stored, and the tokens are those of
    the per-row cache."""
    from bench.dispatch_micro import KernelOps  # operations that run a kernel (not views)

    model = fresh_model(qwen3_dir)
    counts, results = {}, {}
    for layout, n in (("paged", 4), ("paged", 16), ("rows", 16)):
        sampler = Sampler(model, decoder(qwen3_dir), kv_layout=layout, max_rows=32)
        sampler.cache.ensure(32, 4 * PAGE)
        if layout == "paged":
            sampler.cache._make_free(80)  # no pool growth inside the counted admission
        rng = np.random.default_rng(11)
        prompts = [rng.integers(4, 500, 2 * PAGE + 5 + i % 3).tolist() for i in range(n)]
        done: list = []
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                sampler.add(task(f"p{i}", p, max_tokens=1 if i % 4 == 0 else 6, temperature=1.0, seed=i, stop=[]))
            ops = KernelOps()
            with ops:
                sampler._admit(done)
            assert len(done) == n // 4 and len(sampler.rows) == n - n // 4
            assert len(sampler.snapshots) == n  # every prompt's tail kept
            assert sampler.stats["admitting_s"] > 0  # the host's time for it, counted
            while sampler.has_work():
                done += sampler.step(0.05)
        results[layout, n] = {k: r.sequences[0].tokens.tolist() for k, r in done}
        counts[layout, n] = ops.ops
    grown = counts["paged", 16] - counts["paged", 4]
    # each new prompt's last logits and tail copied, no more
    assert grown == {"aten.clone.default": 12, "aten.contiguous.default": 12}, grown
    assert results["paged", 16] == results["rows", 16]
