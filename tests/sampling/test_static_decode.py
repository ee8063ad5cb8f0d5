"""The static decode step (fixed-shape buffers, what CUDA graphs record) run eagerly on the CPU
samples what the eager decode path samples: the same tokens and stop reasons, logprobs equal up to
float rounding (the static step's matmuls and attention run over padded rows and the cache's whole
capacity, other shapes than the eager step's, so the CPU kernels may sum in another order), for
greedy and seeded rows, top-k / top-p, several adapters through the bank with base rows mixed
in, rows joining and leaving (more requests than rows), and K/V cache growth past its blocks;
for hybrid models too, whose Gated DeltaNet states are per-row buffers the step advances."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sampling.conftest import decoder, fresh_model, random_adapter, run, task, three_rows_in_a_bucket_of_four
from tinsmith.models import lora as lora_mod
from tinsmith.sampling.decode_graphs import BUCKETS, DecodeGraphs, bucket_for
from tinsmith.sampling.sampler import Sampler


def _tasks(vocab: int, topk_logprobs: int = 0):
    rng = np.random.default_rng(11)
    stops = sorted(rng.choice(np.arange(4, vocab), size=vocab // 16, replace=False).tolist())
    prompts = [rng.integers(4, vocab, n).tolist() for n in (5, 11, 8, 3, 14, 6, 9)]
    return [
        task("seeded", prompts[0], n=3, max_tokens=30, temperature=1.0, seed=1, stop=stops),
        task("greedy", prompts[1], max_tokens=25, temperature=0.0, stop=stops[::2]),
        task("adapter-a", prompts[2], slot=1, n=2, max_tokens=17, temperature=0.8, top_p=0.9, seed=3, stop=stops),
        task("adapter-b", prompts[3], slot=2, max_tokens=9, temperature=1.0, top_k=20, seed=4, stop=[]),
        # Past the cache's first block of 64 positions: the cache grows under the static step.
        task("long", prompts[4], slot=3, max_tokens=90, temperature=1.0, seed=5, stop=[],
             topk_sample_logprobs=topk_logprobs),
        task("late-greedy-adapter", prompts[5], slot=1, max_tokens=12, temperature=0.0, stop=[]),
        task("late-top-k", prompts[6], n=2, max_tokens=20, temperature=0.7, top_k=5, seed=6, stop=[]),
    ]


def _sample(model_dir, static: bool, topk_logprobs: int = 0, tasks=None, max_rows: int = 6, decode_burst: int = 3):
    """``tasks`` (default :func:`_tasks`) on a fresh model with adapters 1-3; by default max_rows 6
    of 11 rows: the last requests wait, then join as others leave."""
    model = fresh_model(model_dir)
    for slot, rank in ((1, 4), (2, 8), (3, 4)):
        random_adapter(model, slot, rank=rank, seed=slot)
    sampler = Sampler(model, decoder(model_dir), max_rows=max_rows, decode_burst=decode_burst)
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    return run(sampler, tasks or _tasks(model.config.vocab_size, topk_logprobs)), sampler


def _assert_same(ref: dict, got: dict) -> set[str]:
    reasons = set()
    for key, res in ref.items():
        assert not isinstance(res, Exception), res
        for a, b in zip(res.sequences, got[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6, err_msg=key)
            assert a.stop_reason == b.stop_reason, key
            reasons.add(a.stop_reason)
    return reasons


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_static_step_samples_what_the_eager_step_samples(family, monkeypatch, request):
    """Hybrids (qwen3_5) too: their Gated DeltaNet states advance in the step's persistent rows."""
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")  # the layout the static step uses, on both sides
    model_dir = request.getfixturevalue(f"{family}_dir")
    ref, eager = _sample(model_dir, static=False)
    got, static = _sample(model_dir, static=True)
    assert _assert_same(ref, got) == {"stop", "length"}
    assert static.stats["static_steps"] == static.stats["decode_steps"] > 0
    assert static.stats["graph_replays"] == 0  # nothing is captured on a CPU
    assert static.cache.capacity > 64  # the cache grew while the static step ran


def test_rows_asking_top_logprobs_take_the_static_step_too(qwen3_dir, monkeypatch):
    """The step keeps every row's best logprobs as many as the most any row asks (a variant of its
    own); each asking row gets its own k of them, as from the eager step."""
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    ref, _ = _sample(qwen3_dir, static=False, topk_logprobs=2)
    got, static = _sample(qwen3_dir, static=True, topk_logprobs=2)
    _assert_same(ref, got)
    assert static.stats["static_steps"] == static.stats["decode_steps"] > 0
    long_ref, long_got = ref["long"].sequences[0], got["long"].sequences[0]
    assert long_ref.topk_token_ids is not None and len(long_ref.topk_token_ids[0]) == 2
    np.testing.assert_array_equal(long_ref.topk_token_ids, long_got.topk_token_ids)
    np.testing.assert_allclose(long_ref.topk_logprobs, long_got.topk_logprobs, rtol=1e-5, atol=1e-5)
    for key in ref:  # rows that did not ask get none
        if key != "long":
            assert all(s.topk_token_ids is None for s in got[key].sequences), key


def test_single_adapter_batches_go_through_the_bank(qwen3_dir):
    """Rows of one adapter take a plain segment on the eager path and the bank on the static one:
    the same math in another order, so equal up to rounding."""
    results = []
    for static in (False, True):
        model = fresh_model(qwen3_dir)
        random_adapter(model, 1, rank=4, seed=1)
        sampler = Sampler(model, decoder(qwen3_dir))
        if static:
            sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
        results.append(run(sampler, [task("a", [5, 6, 7], slot=1, n=3, max_tokens=12, temperature=0.0, stop=[])]))
    for a, b in zip(results[0]["a"].sequences, results[1]["a"].sequences):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert bucket_for(BUCKETS[-1] + 1) is None


def test_refusals_name_their_reason(qwen3_dir):
    model = fresh_model(qwen3_dir)
    sampler = Sampler(model, decoder(qwen3_dir))
    graphs = DecodeGraphs(model, sampler.cache, capture=False)
    assert "bucket" in graphs.refusal(300)
    assert graphs.refusal(4) is None
    graphs.broken = "RuntimeError: a host read"
    assert "could not be captured" in graphs.refusal(4)


def test_padding_rows_leave_their_cache_rows_untouched(qwen3_dir):
    """Rows past the live ones (3 live rows, bucket 4) may hold someone else's K/V meanwhile."""
    import torch

    sampler = three_rows_in_a_bucket_of_four(qwen3_dir)
    done: list = []
    with torch.inference_mode():
        cache = sampler.cache
        cache.ensure(4, 64)
        for t in cache.K + cache.V:
            t[3].normal_()
        cache.lengths[3] = 9
        before = [t[3].clone() for t in cache.K + cache.V]
        sampler._decode_step(done)
    assert sampler.stats["static_steps"] == 2
    assert int(cache.lengths[3]) == 9 and cache.lengths[:3].tolist() == [6, 6, 6]
    for old, t in zip(before, cache.K + cache.V):
        assert torch.equal(old, t[3])


def test_padding_rows_leave_their_recurrent_states_untouched(qwen3_5_dir):
    """A hybrid's padding rows (3 live rows, bucket 4) keep their Gated DeltaNet states bit for bit."""
    import torch

    sampler = three_rows_in_a_bucket_of_four(qwen3_5_dir)
    done: list = []
    with torch.inference_mode():
        cache = sampler.cache
        cache.ensure(4, 64)
        states = [*cache.recurrent.conv.values(), *cache.recurrent.state.values()]
        for t in states:
            t[3].normal_()
        before = [t[3].clone() for t in states]
        live_before = [t[:3].clone() for t in states]
        sampler._decode_step(done)
    assert sampler.stats["static_steps"] == 2
    for old, live, t in zip(before, live_before, states):
        assert torch.equal(old, t[3])
        assert not torch.equal(live, t[:3])  # the live rows' states did advance


@pytest.mark.parametrize("seed", range(4))
def test_masked_choice_equals_indexed_choice(seed):
    """choose_tokens_masked (every row both ways, kept by mask) picks exactly choose_tokens' tokens."""
    import torch

    from tinsmith.sampling.logits import RowKinds, choose_tokens, choose_tokens_masked, uniforms

    g = torch.Generator().manual_seed(seed)
    rows, vocab = 12, 300
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = [0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.9]
    top_k = [0, 0, 5, 0, 3, 50, 0, 0, 1, 0, 0, 400]
    top_p = [1.0, 1.0, 1.0, 0.8, 0.5, 1.0, 0.95, 1.0, 1.0, 1.0, 0.3, 1.0]
    t, k, p = torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p)
    u = uniforms(torch.full((rows,), seed), torch.arange(rows), torch.full((rows,), 3))
    kinds = RowKinds.of(temperature, top_k, top_p, vocab, logits.device)
    want, want_lp, _ = choose_tokens(logits, t, k, p, u, kinds)
    truncates = torch.zeros(rows, dtype=torch.bool)
    truncates[kinds.truncating] = True
    got, got_lp, _ = choose_tokens_masked(logits, t, k, p, u, truncates, all_greedy=False)
    assert got.tolist() == want.tolist()
    assert torch.equal(got_lp, want_lp)
    greedy, _, _ = choose_tokens_masked(logits, torch.zeros(rows), k, p, u, None, all_greedy=True)
    assert greedy.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_the_static_step_reads_nothing_back_to_the_host(family, layout, request, monkeypatch):
    """What a CUDA graph records must never ask the host anything: the static step of every family
    (adapters through the bank, hybrids' states, gpt-oss' rings and sinks, routed experts through
    the grouped matmul, pages, top-k sample logprobs) runs here with every host read of a tensor turned into a failure."""
    import torch

    from tinsmith.models import moe

    if not hasattr(torch, "_grouped_mm") and family == "qwen3_moe":
        pytest.skip("this torch has no grouped matmul")
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")  # what bf16 on Hopper takes
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    real_step = DecodeGraphs._step
    steps = []

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside the static decode step")

    def guarded_step(self, *args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, refuse)
            m.setattr(torch, "bincount", refuse)
            real_step(self, *args, **kwargs)
        steps.append(1)

    monkeypatch.setattr(DecodeGraphs, "_step", guarded_step)
    model_dir = request.getfixturevalue(f"{family}_dir")
    model = fresh_model(model_dir)
    random_adapter(model, 1, rank=4, seed=1)
    sampler = Sampler(model, decoder(model_dir), decode_burst=3, kv_layout=layout)
    sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    out = run(sampler, [task("a", list(range(4, 80)), slot=1, n=2, max_tokens=20, temperature=1.0, seed=1, stop=[]),
                        task("b", [5, 6, 7], max_tokens=15, temperature=0.7, top_p=0.9, seed=2, stop=[],
                             topk_sample_logprobs=2)])
    assert not any(isinstance(r, Exception) for r in out.values()), out
    assert steps and sampler.stats["static_steps"] == len(steps)


@pytest.mark.parametrize("static", [False, True])
def test_segmented_lora_kernels_sample_what_the_gathered_ones_sample(static, qwen3_dir, monkeypatch):
    """Rows of three adapters (two rows of one) and of none, the LoRA layers on Triton's kernels
    (interpreted): by tiles of rows sharing an adapter as by rows, eagerly and through the static
    step (its persistent tile tables, changed in place as rows join and leave)."""
    from tinsmith.kernels import lora_gather, lora_segments

    if not (lora_gather.triton_available() and lora_gather.triton_interpreting()):
        pytest.skip("needs triton, and TRITON_INTERPRET=1 set before triton was imported")
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    monkeypatch.setattr(lora_gather, "BACKEND", "triton")
    tiled: list[int] = []
    real = lora_segments.shrink
    monkeypatch.setattr(lora_segments, "shrink",
                        lambda x, A, tiles, *a: (tiled.append(tiles.tiles), real(x, A, tiles, *a))[1])

    def sample(segmented: bool):
        monkeypatch.setattr(lora_segments, "ENABLED", segmented)
        tasks = [task("a", [5, 6, 7], slot=1, n=2, max_tokens=4, temperature=0.9, seed=1, stop=[]),
                 task("b", [8, 9], slot=2, max_tokens=3, temperature=0.0, stop=[]),
                 task("base", [4, 5, 6, 7], max_tokens=2, temperature=1.0, seed=2, stop=[]),
                 task("c", [10, 11, 12], slot=3, max_tokens=3, temperature=1.0, seed=3, stop=[])]
        return _sample(qwen3_dir, static, tasks=tasks, max_rows=4, decode_burst=2)

    ref, _ = sample(False)
    assert not tiled
    got, sampler = sample(True)
    assert tiled and (sampler.stats.get("static_steps", 0) > 0) == static
    _assert_same(ref, got)
