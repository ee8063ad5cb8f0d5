"""Chunked prefill: a long prompt is prefilled a chunk per scheduler step, with the running rows
decoding in between, and every result equals that of a whole-prompt prefill."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, scheduler_steps, task
from tests.sampling.test_prefix_cache import TOL, assert_same, results, tokens

CHUNK = 24  # tiny-model prompts of a few chunks: exercise chunk edges without slow tests


def long_requests(prefix: str = "r", **kw) -> list:
    """Prompts shorter than, equal to, and several chunks longer than CHUNK (one ends on a chunk edge)."""
    lengths = [CHUNK - 5, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 7]
    return [task(f"{prefix}{i}", tokens(40 + i, n), max_tokens=6, seed=200 + i, **kw) for i, n in enumerate(lengths)]


def assert_prompt_outputs_same(got: dict, want: dict) -> None:
    """Top-k prompt logprobs: the same ids (where values are apart) and values within TOL."""
    for key, w in want.items():
        g = got[key]
        np.testing.assert_allclose(g.topk_prompt_logprobs, w.topk_prompt_logprobs, atol=TOL, rtol=0)
        assert (g.topk_prompt_token_ids == w.topk_prompt_token_ids).mean() > 0.99, key


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunked_equals_whole_prefill(family, temperature, model_dirs, gpt_oss_dir):
    """Sampled tokens (seeded), their logprobs and top-k logprobs, prompt logprobs and top-k
    prompt logprobs are those of whole-prompt prefills; gpt-oss has sinks and a sliding window
    shorter than the prompts."""
    model_dir = gpt_oss_dir if family == "gpt_oss" else model_dirs[family]
    model = fresh_model(model_dir)
    whole = make_sampler(model, model_dir, prefill_chunk_tokens=0, prefix_cache_bytes=0)
    chunked = make_sampler(model, model_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0)
    kw = dict(temperature=temperature, prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=3)
    want = results(whole, long_requests(**kw))
    got = results(chunked, long_requests(**kw))
    assert_same(got, want)
    assert_prompt_outputs_same(got, want)
    for key, w in want.items():
        for sg, sw in zip(got[key].sequences, w.sequences):
            np.testing.assert_allclose(sg.topk_logprobs, sw.topk_logprobs, atol=TOL, rtol=0)
    assert whole.stats["prefill_chunks"] == 0
    # 3 prompts longer than a chunk: 2 + 3 + 4 chunks
    assert chunked.stats["prefill_chunks"] == 9
    assert chunked.stats["prefill_tokens"] == whole.stats["prefill_tokens"]


def test_chunked_with_adapters_and_samples_equals_whole(qwen3_dir):
    """Adapter slots and several samples per request: the same tokens and logprobs as whole prefills."""
    model = fresh_model(qwen3_dir)
    random_adapter(model, 1, seed=1)
    random_adapter(model, 2, seed=2)
    make = lambda: [task(f"a{i}", tokens(60 + i, 2 * CHUNK + 3 * i), slot=[None, 1, 2][i], n=3, max_tokens=5,
                         seed=i, temperature=1.0) for i in range(3)]
    want = results(make_sampler(model, qwen3_dir, prefill_chunk_tokens=0, prefix_cache_bytes=0), make())
    got = results(make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0), make())
    assert_same(got, want)


def test_running_rows_decode_between_the_chunks_of_a_long_prompt(qwen3_dir):
    """A long prompt admitted while rows decode: every chunk is followed by a decode step of the
    running rows (they never wait for the whole prefill), and the long prompt's rows join once
    its last chunk is done."""
    model = fresh_model(qwen3_dir)
    sampler = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0)
    sampler.add(task("short", tokens(1, 8), n=2, max_tokens=40, seed=1, temperature=1.0))
    sampler.step(0.0)  # admitted and prefilled; no decode step within a spent budget
    assert len(sampler.rows) == 2
    sampler.add(task("long", tokens(2, 5 * CHUNK), max_tokens=4, seed=2, temperature=1.0))
    for _ in range(5):
        sampler.step(0.0)  # a spent budget runs no scheduler step: nothing moves
    assert sampler.stats["prefill_chunks"] == 0 and sampler._chunked is not None
    out: dict = {}
    chunks, decodes, progress = [], [], []
    for _ in range(100):
        if not sampler.has_work():
            break
        out.update(scheduler_steps(sampler, 1))
        chunks.append(sampler.stats["prefill_chunks"])
        decodes.append(sampler.stats["decode_steps"])
        progress.append(min((len(t) for k, _, t in sampler.running() if k == "short"), default=None))
    assert chunks[:6] == [1, 2, 3, 4, 5, 5]
    assert decodes[:5] == [1, 2, 3, 4, 5]  # a decode step after every chunk
    assert progress[:5] == [2, 3, 4, 5, 6]  # the short rows gained a token per chunk of the long prompt
    assert set(out) == {"short", "long"}
    want = run(make_sampler(model, qwen3_dir, prefill_chunk_tokens=0, prefix_cache_bytes=0), [
        task("short", tokens(1, 8), n=2, max_tokens=40, seed=1, temperature=1.0),
        task("long", tokens(2, 5 * CHUNK), max_tokens=4, seed=2, temperature=1.0)])
    assert_same(out, want)


def test_short_prompts_are_admitted_beside_a_chunked_one_and_long_ones_queue(qwen3_dir):
    """Short prompts behind a long one are prefilled together as before; a second long prompt
    waits (in queue order) until the first one's chunks are done."""
    model = fresh_model(qwen3_dir)
    sampler = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0)
    for t in [task("long0", tokens(5, 3 * CHUNK), max_tokens=3, seed=5),
              task("long1", tokens(6, 2 * CHUNK), max_tokens=3, seed=6),
              task("s0", tokens(7, 10), max_tokens=3, seed=7)]:
        sampler.add(t)
    sampler.step(0.0)
    assert sampler._chunked.state.task.key == "long0"
    assert [t.key for t in sampler.inbox] == ["long1", "s0"]  # s0 waits behind long1 (queue order)
    out = run(sampler, [])
    assert set(out) == {"long0", "long1", "s0"}
    assert sampler.stats["prefill_chunks"] == 5


def test_chunks_fill_and_read_the_prefix_cache(qwen3_dir):
    """Each chunk's full blocks enter the prefix cache; a later prompt sharing the long prefix
    reads them (and is chunked only over the rest), with results equal to an uncached sampler."""
    model = fresh_model(qwen3_dir)
    cached = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK)
    plain = make_sampler(model, qwen3_dir, prefill_chunk_tokens=0, prefix_cache_bytes=0)
    system = tokens(11, 4 * CHUNK + 3)
    first = [task("first", system + tokens(12, 5), max_tokens=5, seed=1, temperature=1.0)]
    second = lambda: [task("second", system + tokens(13, 2 * CHUNK), max_tokens=5, seed=2, temperature=1.0)]
    assert_same(results(cached, first), results(plain, [task("first", system + tokens(12, 5), max_tokens=5,
                                                             seed=1, temperature=1.0)]))
    before = cached.stats["prefill_chunks"]
    got = results(cached, second())
    assert got["second"].prompt_cache_hit_tokens == len(system) // cached.prefix.block * cached.prefix.block
    computed = len(system) + 2 * CHUNK - got["second"].prompt_cache_hit_tokens
    assert cached.stats["prefill_chunks"] - before == -(-computed // CHUNK)
    assert_same(got, results(plain, second()))


def test_cancelling_a_prompt_between_its_chunks(qwen3_dir):
    """A request cancelled while its prompt is half prefilled is reported cancelled; the others go on."""
    from tinsmith.sampling.cancel import CancelBoard, SampleCancelled

    board = CancelBoard(lambda key: key)
    model = fresh_model(qwen3_dir)
    sampler = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK, prefix_cache_bytes=0, cancellations=board)
    sampler.add(task("long", tokens(3, 4 * CHUNK), max_tokens=3, seed=3))
    sampler.add(task("short", tokens(4, 8), max_tokens=3, seed=4))
    scheduler_steps(sampler, 1)
    assert sampler._chunked is not None and sampler._chunked.done == CHUNK
    board.post("long")
    out = run(sampler, [])
    assert isinstance(out["long"], SampleCancelled)
    assert not isinstance(out["short"], Exception)
    assert sampler._chunked is None and not sampler.has_work()


@pytest.mark.parametrize("family_dir", ["qwen3_5_dir", "qwen3_5_moe_dir"])
def test_hybrid_models_carry_their_recurrent_states_across_chunks(family_dir, request):
    """Qwen3.5's Gated DeltaNet layers continue each chunk from the convolution inputs and
    delta-rule state the chunk before left: results equal whole prefills (chunks of 64, the
    delta rule's own chunk, and of 24, across its chunk edges)."""
    model_dir = request.getfixturevalue(family_dir)
    model = fresh_model(model_dir)
    kw = dict(temperature=1.0, prompt_logprobs=True, topk_prompt_logprobs=3)
    want = results(make_sampler(model, model_dir, prefill_chunk_tokens=0), long_requests(**kw))
    for chunk in (CHUNK, 64):
        sampler = make_sampler(model, model_dir, prefill_chunk_tokens=chunk)
        got = results(sampler, long_requests(**kw))
        assert sampler.stats["prefill_chunks"] > 0
        for key, w in want.items():  # rounding of the chunked delta rule and the convolution: fp32 apart
            g = got[key]
            for sg, sw in zip(g.sequences, w.sequences):
                assert sg.tokens.tolist() == sw.tokens.tolist(), key
                np.testing.assert_allclose(sg.logprobs, sw.logprobs, atol=1e-4, rtol=0)
            np.testing.assert_allclose(g.prompt_logprobs, w.prompt_logprobs, atol=1e-4, rtol=0, equal_nan=True)
            np.testing.assert_allclose(g.topk_prompt_logprobs, w.topk_prompt_logprobs, atol=1e-4, rtol=0)


def test_scoring_a_long_prompt_in_chunks(qwen3_dir):
    """``max_tokens=1`` calls (compute_logprobs) on a long prompt: prompt logprobs equal a whole
    prefill's, and the request finishes with its last chunk."""
    model = fresh_model(qwen3_dir)
    make = lambda: [task("score", tokens(21, 4 * CHUNK + 2), max_tokens=1, seed=5, prompt_logprobs=True)]
    want = results(make_sampler(model, qwen3_dir, prefill_chunk_tokens=0), make())
    sampler = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK)
    got = results(sampler, make())
    assert_same(got, want)
    assert sampler.stats["prefill_chunks"] == 5 and sampler.stats["decode_steps"] == 0


def test_a_chunked_prompt_holds_its_rows_against_the_kv_budget(qwen3_dir):
    """While its chunks run, a long prompt's rows count against the K/V budget: requests behind
    it wait, the buffers never outgrow the budget, and results equal an unbounded sampler's."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 128 * cfg.head_dim * 4  # one row of 128 positions
    bounded = make_sampler(model, qwen3_dir, prefill_chunk_tokens=CHUNK, kv_cache_bytes=row_bytes)
    make = lambda: [task("long", tokens(31, 3 * CHUNK), max_tokens=8, seed=1, temperature=1.0),
                    task("next", tokens(32, 10), max_tokens=8, seed=2, temperature=1.0)]
    for t in make():
        bounded.add(t)
    bounded.step(0.0)
    assert bounded._chunked is not None and [t.key for t in bounded.inbox] == ["next"]
    out: dict = {}
    while bounded.has_work():
        out.update(scheduler_steps(bounded, 1))
        assert len(bounded.rows) <= 1 and bounded.cache.nbytes() <= row_bytes
    assert_same(out, run(make_sampler(model, qwen3_dir, prefill_chunk_tokens=0, kv_cache_bytes=0), make()))


def test_preemption_returns_what_an_unbounded_sampler_returns_and_never_overruns(qwen3_dir):
    """Rows are admitted by what they hold; when they outgrow the K/V budget the newest requests
    are preempted and resume later. The buffers never outgrow the budget, more rows run at once
    than at-their-longest admission allowed, and every result equals an unbounded sampler's."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 64 * cfg.head_dim * 4  # one row of 64 positions
    budget = 6 * row_bytes
    make = lambda: [task(f"p{i}", tokens(70 + i, 8 + i), n=1 + i % 2, max_tokens=150 + 10 * i, seed=i,
                         temperature=1.0, topk_sample_logprobs=2) for i in range(5)]
    bounded = make_sampler(model, qwen3_dir, kv_cache_bytes=budget, prefix_cache_bytes=0)
    for t in make():
        bounded.add(t)
    out: dict = {}
    peak = 0
    while bounded.has_work():
        out.update(scheduler_steps(bounded, 1))
        peak = max(peak, len(bounded.rows))
        assert bounded.cache.nbytes() <= budget
    assert bounded.stats["preempted"] > 0 and bounded.stats["recomputed_tokens"] > 0
    assert peak >= 3  # counted at their longest (158-198 positions: 3-4 blocks each) at most 2 rows fit
    want = run(make_sampler(model, qwen3_dir, kv_cache_bytes=0, prefix_cache_bytes=0), make())
    assert_same(out, want)
    for key, w in want.items():
        for sg, sw in zip(out[key].sequences, w.sequences):
            np.testing.assert_allclose(sg.topk_logprobs, sw.topk_logprobs, atol=TOL, rtol=0)


def test_preemption_on_a_hybrid_model_keeps_results(qwen3_5_dir):
    """Resumed rows of a hybrid model recompute their recurrent states with their K/V."""
    model = fresh_model(qwen3_5_dir)
    unit = make_sampler(model, qwen3_5_dir).cache.bytes_for([64])  # one row of one block, as admission counts it
    # At their longest (258 positions: 5 blocks) one row fits; held (2 blocks as they start) two do.
    make = lambda: [task(f"h{i}", tokens(80 + i, 8), max_tokens=250, seed=i, temperature=1.0) for i in range(3)]
    bounded = make_sampler(model, qwen3_5_dir, kv_cache_bytes=5 * unit)
    got = run(bounded, make())
    assert bounded.stats["preempted"] > 0
    want = run(make_sampler(model, qwen3_5_dir, kv_cache_bytes=0), make())
    for key, w in want.items():  # states recomputed by the chunked rule, not step by step: fp32 rounding apart
        (g,), (w,) = got[key].sequences, w.sequences
        assert g.tokens.tolist() == w.tokens.tolist(), key
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4, rtol=0)


def test_a_prompt_preempted_while_chunked_starts_over_with_the_same_result(qwen3_dir):
    """An older row outgrows the budget while a newer long prompt is being chunked: the prompt
    (the newest request) goes back to the queue, starts over once there is room, and its result
    equals an unbounded sampler's."""
    model = fresh_model(qwen3_dir)
    unit = make_sampler(model, qwen3_dir).cache.bytes_for([64])  # one row of one block, as admission counts it
    # "old" fits alone at its longest (504 positions: 8 blocks); "long" (200 + 4: 4 blocks, 100
    # chunks of 2) is admitted beside it while it holds at most 4 blocks, and preempted when it
    # outgrows them (65 decode steps later).
    sampler = make_sampler(model, qwen3_dir, prefill_chunk_tokens=2, prefix_cache_bytes=0, kv_cache_bytes=8 * unit)
    make = lambda: [task("old", tokens(90, 4), max_tokens=500, seed=1, temperature=1.0),
                    task("long", tokens(91, 200), max_tokens=4, seed=2, temperature=1.0)]
    old, long = make()
    sampler.add(old)
    out: dict = {}
    while not sampler.rows or len(sampler.rows[0].tokens) < 185:
        out.update(scheduler_steps(sampler, 1))
        assert not out, out
    sampler.add(long)
    requeued = False
    while sampler.has_work():
        out.update(scheduler_steps(sampler, 1))
        requeued |= any(t.key == "long" for t in sampler.inbox) and sampler.stats["prefill_chunks"] > 0
        assert sampler.cache.nbytes() <= 8 * unit
    assert requeued and sampler.stats["preempted"] == 1
    assert sampler.stats["prefill_chunks"] > 100  # 100 chunks for the prompt, and the ones lost before
    assert_same(out, run(make_sampler(model, qwen3_dir, kv_cache_bytes=0, prefix_cache_bytes=0), make()))
