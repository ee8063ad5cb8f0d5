"""Sliding-window layers keep a ring of their window in the KV cache, not every position.

The tiny gpt-oss slides a 16-token window on layer 0 (a 64-position ring: one block) and attends
fully on layer 1. Prompts and generations run far past the ring, so positions wrap in it: from the
prefill (a prompt longer than the ring), in decoding, in prompts prefilled in chunks, through the
prefix cache, with rows of different lengths finishing and moving, and through the static decode
step. Greedy tokens are transformers' own, sampled-token logprobs those of a full forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.helpers import reference_model
from tests.sampling.conftest import forward_logprobs, make_sampler, run, task
from tinsmith.models.loading import load_model
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.sampling.kv_cache import RowKVCache

VOCAB, WINDOW, RING = 512, 16, 64


@pytest.fixture(scope="module")
def model(gpt_oss_dir):
    return load_model(str(gpt_oss_dir)).model


@pytest.fixture(scope="module")
def generated(gpt_oss_dir):
    """transformers' greedy continuation of a prompt, memoised by (prompt, tokens)."""
    hf = reference_model(gpt_oss_dir).eval()
    memo: dict = {}

    def continuation(prompt: list[int], new: int) -> list[int]:
        key = (tuple(prompt), new)
        if key not in memo:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=3)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return continuation


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, n).tolist() for n in lengths]


def _check(model, generated, prompt, result, new) -> None:
    seq = result.sequences[0]
    assert seq.tokens.tolist() == generated(prompt, new)
    lp = forward_logprobs(model, prompt + seq.tokens.tolist())
    want = lp[len(prompt) - 1: -1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
    np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [None, 24, 80], ids=["whole", "chunks-below-ring", "chunks-above-ring"])
def test_rows_of_every_length_decode_as_transformers_past_the_ring(model, gpt_oss_dir, generated, chunk):
    """A batch of prompts shorter and longer than the ring, with generations that end at
    different steps (rows move when one finishes), prefilled whole or in chunks."""
    prompts = _prompts((150, 7, 70, 3 * RING + 5))
    news = (40, 90, 20, 33)
    sampler = make_sampler(model, gpt_oss_dir, prefill_chunk_tokens=chunk)
    res = run(sampler, [task(i, p, max_tokens=n, temperature=0.0, stop=[]) for i, (p, n) in enumerate(zip(prompts, news))])
    for i, (p, n) in enumerate(zip(prompts, news)):
        _check(model, generated, p, res[i], n)
    sliding, full = sampler.cache.K[0], sampler.cache.K[1]
    assert sliding.shape[2] == RING  # per-row rings in either layout
    if not sampler.paged_kv:  # per-row buffers of the longest row (pages: see test_paged_kv_cache)
        assert full.shape[2] >= 3 * RING + 5 + 33


def test_a_prompt_served_from_the_prefix_cache_wraps_the_same(model, gpt_oss_dir, generated):
    """The same long prompt sent again later (its blocks from the prefix cache), and a longer one
    extending it."""
    (p,) = _prompts((2 * RING + 9,), seed=3)
    longer = p + _prompts((40,), seed=4)[0]
    sampler = make_sampler(model, gpt_oss_dir)
    first = run(sampler, [task("a", p, max_tokens=30, temperature=0.0, stop=[])])["a"]
    again = run(sampler, [task("b", p, max_tokens=30, temperature=0.0, stop=[]),
                          task("c", longer, max_tokens=25, temperature=0.0, stop=[])])
    assert sampler.stats["cached_prompt_tokens"] > 0
    _check(model, generated, p, first, 30)
    _check(model, generated, p, again["b"], 30)
    _check(model, generated, longer, again["c"], 25)


def test_the_static_decode_step_wraps_the_ring_as_the_eager_one(model, gpt_oss_dir):
    """The fixed-shape step (what CUDA graphs replay; eager here) samples what the eager decode samples."""
    prompts = _prompts((100, 9), seed=5)
    tasks = lambda: [task(i, p, max_tokens=70, temperature=1.0, seed=11 + i, stop=[])  # noqa: E731
                     for i, p in enumerate(prompts)]
    eager = run(make_sampler(model, gpt_oss_dir), tasks())
    static_sampler = make_sampler(model, gpt_oss_dir)
    static_sampler.graphs = DecodeGraphs(model, static_sampler.cache, capture=False, stats=static_sampler.stats)
    static = run(static_sampler, tasks())
    assert static_sampler.stats.get("static_steps", 0) > 0
    for i in eager:
        a, b = eager[i].sequences[0], static[i].sequences[0]
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_sliding_layers_hold_a_ring_and_the_budget_admits_more_rows(gpt_oss_dir, qwen3_dir):
    cfg = load_model(str(gpt_oss_dir)).config
    cache = RowKVCache(cfg, torch.device("cpu"), torch.float32, rows=2)
    assert cache.rings[0] == RING and cache.rings[1] is None
    per_layer_position = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for capacity in (64, 1024, 8192):
        assert cache.row_bytes(capacity) == per_layer_position * (min(capacity, RING) + capacity)
    cache.ensure(2, 1000)
    assert cache.K[0].shape[2] == RING and cache.K[1].shape[2] >= 1000
    budget = 40 * cache.row_bytes(4096)
    ring_cache = RowKVCache(cfg, torch.device("cpu"), torch.float32, rows=1, max_bytes=budget)
    whole = RowKVCache(cfg, torch.device("cpu"), torch.float32, rows=1, max_bytes=budget)
    whole.rings = [None] * cfg.num_layers  # as before: every layer keeps every position
    assert ring_cache._rows_within(1000, 4096) == 40 and whole._rows_within(1000, 4096) < 40
    # a model without sliding layers is as it was
    plain = RowKVCache(load_model(str(qwen3_dir)).config, torch.device("cpu"), torch.float32)
    assert all(r is None for r in plain.rings)
