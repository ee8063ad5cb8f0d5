"""Prefix caching across requests: results with a cache hit equal those without, never stale.

Every check runs the same requests on two samplers over the same model: one with the prefix
cache off (each prompt prefilled whole) and one with it on, warmed so that the requests hit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sampling.conftest import fresh_model, make_sampler, random_adapter, run, scheduler_steps, task
from tinsmith.sampling.prefix_cache import BLOCK, PrefixCache
from tinsmith.sampling.sampler import TAIL_BUDGET_SHARE
from tinsmith.types import AdamParams, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime

TOL = 1e-5
SNAP_A, SNAP_B = 1_000_001, 1_000_002


def tokens(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(4, vocab, n).tolist()


def results(sampler, tasks) -> dict:
    out = run(sampler, tasks)
    for key, res in out.items():
        assert not isinstance(res, Exception), f"{key}: {res!r}"
    return out


def assert_same(got: dict, want: dict) -> None:
    """Same tokens and stop reasons, logprobs within TOL (prompt logprobs too when asked)."""
    assert got.keys() == want.keys()
    for key in want:
        g, w = got[key], want[key]
        for sg, sw in zip(g.sequences, w.sequences, strict=True):
            assert sg.tokens.tolist() == sw.tokens.tolist(), key
            assert sg.stop_reason == sw.stop_reason
            np.testing.assert_allclose(sg.logprobs, sw.logprobs, atol=TOL, rtol=0, err_msg=str(key))
        if w.prompt_logprobs is not None:
            np.testing.assert_allclose(g.prompt_logprobs, w.prompt_logprobs, atol=TOL, rtol=0, equal_nan=True)


def multi_turn(seed: int = 0, block: int = BLOCK) -> tuple[list[int], list[list[int]]]:
    """A shared system prompt (three blocks and a bit) and continuations of it, as turns grow."""
    system = tokens(seed, 3 * block + 5)
    return system, [system + tokens(seed + 1 + i, 7 + 9 * i) for i in range(4)]


def requests(prompts, prefix: str, **kw) -> list:
    return [task(f"{prefix}{i}", p, max_tokens=6, seed=100 + i, **kw) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_cache_hit_equals_whole_prefill(family, temperature, layout, model_dirs, gpt_oss_dir, qwen3_moe_dir):
    """Greedy and sampled tokens and their logprobs are those of a whole prefill; gpt-oss has
    sinks and a sliding window shorter than the cached prefix. Over pages the blocks are pool
    pages (gpt-oss' rings keep their part beside them)."""
    model_dir = {"gpt_oss": gpt_oss_dir, "qwen3_moe": qwen3_moe_dir}.get(family) or model_dirs[family]
    model = fresh_model(model_dir)
    plain = make_sampler(model, model_dir, prefix_cache_bytes=0, kv_layout=layout)
    cached = make_sampler(model, model_dir, kv_layout=layout)
    block = cached.prefix.block
    system, prompts = multi_turn(block=block)
    want = results(plain, requests(prompts, "t", temperature=temperature))
    results(cached, requests([system + tokens(99, 3)], "warm"))  # fills the system prompt's blocks
    got = results(cached, requests(prompts, "t", temperature=temperature))
    assert_same(got, want)
    assert all(r.prompt_cache_hit_tokens == 3 * block for r in got.values())
    assert all(r.prompt_cache_hit_tokens == 0 for r in want.values())
    # A second round finds each whole turn: its blocks, and the tail and last logits the first
    # round kept beside them, so no prompt runs a forward pass again.
    prefills = cached.stats["prefills"]
    again = results(cached, requests(prompts, "t", temperature=temperature))
    assert_same(again, want)
    assert [again[f"t{i}"].prompt_cache_hit_tokens for i in range(4)] == [len(p) for p in prompts]
    assert cached.stats["prefills"] == prefills


def test_separate_requests_of_one_prompt_share_one_prefill(qwen3_dir):
    """GRPO sends one prompt as many requests: admitted together, they are prefilled once."""
    model = fresh_model(qwen3_dir)
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir)
    prompt = tokens(3, 40)
    tasks = [task(f"g{i}", prompt, max_tokens=5, seed=i, temperature=1.0) for i in range(8)]
    want = results(plain, tasks)
    got = results(cached, [task(f"g{i}", prompt, max_tokens=5, seed=i, temperature=1.0) for i in range(8)])
    assert_same(got, want)
    assert plain.stats["prefills"] == 8 and cached.stats["prefills"] == 1
    assert sorted(r.prompt_cache_hit_tokens for r in got.values()) == [0] + [40] * 7
    # A shared prompt counts once against the prefill budget, so the whole group is admitted at once.
    tight = make_sampler(model, qwen3_dir, prefill_tokens=50)
    got = results(tight, [task(f"g{i}", prompt, max_tokens=5, seed=i, temperature=1.0) for i in range(8)])
    assert_same(got, want)
    assert tight.stats["prefills"] == 1 and tight.stats["decode_steps"] == plain.stats["decode_steps"]


@pytest.mark.parametrize("layout", ["rows", "paged"])
@pytest.mark.parametrize("extra", [0, 5])  # whole blocks (nothing past them to keep), and a tail of 5 positions
def test_a_prompt_sent_again_in_later_admissions_runs_no_forward_pass(layout, extra, qwen3_dir):
    """GRPO's separate requests arriving over several scheduler steps: the first admission
    prefills the prompt, later ones seed their rows from its cached blocks and the tail and last
    logits kept beside them, so no forward pass runs again; every request's tokens and logprobs
    equal a sampler's without a cache."""
    model = fresh_model(qwen3_dir)
    cached = make_sampler(model, qwen3_dir, kv_layout=layout)
    block = cached.prefix.block  # a page over pages
    prompt = tokens(11, 2 * block + extra)
    make = lambda i: task(f"g{i}", prompt, max_tokens=8, seed=i, temperature=1.0)  # noqa: E731
    want = results(make_sampler(model, qwen3_dir, prefix_cache_bytes=0, kv_layout=layout), [make(i) for i in range(6)])
    got: dict = {}
    for i in range(6):  # one request an admission, while the earlier ones decode
        cached.add(make(i))
        got.update(scheduler_steps(cached, 1))
    got.update(results(cached, []))
    assert_same(got, want)
    assert cached.stats["prefills"] == 1 and cached.stats["prefill_tokens"] == len(prompt)
    assert sorted(r.prompt_cache_hit_tokens for r in got.values()) == [0] + [len(prompt)] * 5
    (kept,) = cached.snapshots.entries.values()
    assert kept.start == 2 * block and kept.tail.shape[3] == extra


def test_a_kept_tail_waits_for_its_blocks_and_its_budget(qwen3_dir):
    """A kept tail is used only while the prefix cache holds every block before it (evicted
    blocks: the prompt is prefilled again), and tails stay within their share of the budget;
    a prompt prefilled in chunks is kept too. Results stay exact throughout."""
    model = fresh_model(qwen3_dir)
    long = tokens(12, 6 * BLOCK + 3)
    short = tokens(13, BLOCK + 7)
    make = lambda key, p, seed: task(key, p, max_tokens=5, seed=seed, temperature=1.0)  # noqa: E731
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir, prefill_chunk_tokens=2 * BLOCK)  # the long prompt in chunks
    for key, p in (("long", long), ("short", short)):
        assert_same(results(cached, [make(key, p, 1)]), results(plain, [make(key, p, 1)]))
    assert cached.stats["prefill_chunks"] == 4 and len(cached.snapshots) == 2
    prefills = cached.stats["prefills"]
    got = results(cached, [make("long2", long, 2), make("short2", short, 3)])
    assert_same(got, results(plain, [make("long2", long, 2), make("short2", short, 3)]))
    assert cached.stats["prefills"] == prefills and cached.stats["prefill_chunks"] == 4  # neither runs again
    cached.prefix.clear()  # the blocks go: their tails cannot be used alone
    got = results(cached, [make("long3", long, 4)])
    assert_same(got, results(plain, [make("long3", long, 4)]))
    assert got["long3"].prompt_cache_hit_tokens == 0 and cached.stats["prefill_chunks"] == 8
    one = cached.snapshots.entries[next(iter(cached.snapshots.entries))].nbytes
    tight = make_sampler(model, qwen3_dir, prefix_cache_bytes=TAIL_BUDGET_SHARE * (one + one // 2))
    for i, p in enumerate((long, short, long)):
        assert_same(results(tight, [make(f"t{i}", p, i)]), results(plain, [make(f"t{i}", p, i)]))
        assert len(tight.snapshots) == 1 and tight.snapshots.bytes <= tight.snapshots.max_bytes


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_prompts_behind_one_system_prompt_sent_together_compute_it_once(layout, qwen3_dir):
    """GRPO groups of different questions behind one system prompt, all queued at once: the first
    prompt is prefilled whole, the others wait one admission for its blocks and compute only what
    follows them; identical prompts still share the first prefill. Results equal a sampler
    without the cache."""
    model = fresh_model(qwen3_dir)
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0, kv_layout=layout)
    cached = make_sampler(model, qwen3_dir, kv_layout=layout)
    block = cached.prefix.block
    system = tokens(5, 2 * 64 + 7)  # at least BRANCH_MIN_TOKENS past whole blocks, in either layout
    prompts = [system + tokens(60 + i, 9 + i) for i in range(4)]
    make = lambda: [task(f"q{i}s{j}", p, max_tokens=5, seed=10 * i + j, temperature=1.0)  # noqa: E731
                    for i, p in enumerate(prompts) for j in range(3)]
    want = results(plain, make())
    got = results(cached, make())
    assert_same(got, want)
    shared = len(system) // block * block
    assert cached.stats["prefills"] == 4 and cached.stats["prefill_tokens"] == len(prompts[0]) + sum(
        len(p) - shared for p in prompts[1:])
    hits = {key: r.prompt_cache_hit_tokens for key, r in got.items()}
    assert hits["q0s0"] == 0 and hits["q0s1"] == hits["q0s2"] == len(prompts[0])  # shared the first prefill
    assert all(hits[f"q{i}s0"] == shared for i in (1, 2, 3))


def test_a_request_waits_for_a_shared_beginning_at_most_once(qwen3_dir):
    """Where the prefix cache cannot keep the shared blocks (a budget below one block), the
    requests that waited for them are admitted at the next admission all the same."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * BLOCK * cfg.head_dim * 4
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    tiny = make_sampler(model, qwen3_dir, prefix_cache_bytes=block_bytes // 2, kv_layout="rows")
    system = tokens(7, 100)
    make = lambda: [task(f"w{i}", system + tokens(70 + i, 5), max_tokens=4, seed=i) for i in range(3)]  # noqa: E731
    want = results(plain, make())
    for t in make():
        tiny.add(t)
    with torch.inference_mode():
        tiny._admit([])
        assert [row.state.task.key for row in tiny.rows] == ["w0"] and len(tiny.inbox) == 2
        tiny._admit([])  # nothing was cached: they do not wait again
        assert sorted(row.state.task.key for row in tiny.rows) == ["w0", "w1", "w2"] and not tiny.inbox
    got = {}
    while tiny.has_work():
        got.update(tiny.step(0.05))
    assert_same(got, want)
    assert tiny.stats["cached_prompt_tokens"] == 0 and not tiny._waited


def test_live_adapter_never_reads_entries_of_older_weights(qwen3_dir):
    """After an optimizer step (and after loading weights) the live adapter's prompts are
    prefilled again: results equal a sampler without a cache, and differ from before the step."""
    model = fresh_model(qwen3_dir)
    rt = TrainingRuntime(model, max_lora_adapters=4, max_lora_rank=16)
    unit = rt.create_adapter(LoraSpec(rank=4, alpha=8, seed=1))
    tr = rt.unit(unit)
    slot = tr.slot
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir)
    _, prompts = multi_turn(5)
    g = torch.Generator().manual_seed(0)

    def step():
        for p in tr.params:
            p.grad = torch.randn(p.shape, generator=g)
        tr.step(AdamParams(learning_rate=0.05))

    step()  # B is no longer zero: the adapter changes the outputs
    before = results(cached, requests(prompts, "a", slot=slot))
    assert_same(results(cached, requests(prompts, "a", slot=slot)), before)  # hits, same weights
    assert cached.prefix.stats["hit_tokens"] > 0
    step()
    got = results(cached, requests(prompts, "a", slot=slot))
    want = results(plain, requests(prompts, "a", slot=slot))
    assert_same(got, want)
    assert all(r.prompt_cache_hit_tokens == 0 for r in got.values())
    moved = max(float(np.abs(got[k].sequences[0].logprobs - before[k].sequences[0].logprobs).max()) for k in got)
    assert moved > 1e-3, "the step should change the outputs, or this test proves nothing"

    weights, opt = tr.export_state()
    step()
    results(cached, requests(prompts, "a", slot=slot))  # cache the stepped weights' blocks
    tr.import_state(weights, opt)  # back to the earlier weights: a new version again
    assert_same(results(cached, requests(prompts, "a", slot=slot)), want)


def test_tenants_never_share_entries(qwen3_dir):
    """Two adapters (and the base model) sampling one prompt each compute their own K/V."""
    model = fresh_model(qwen3_dir)
    random_adapter(model, SNAP_A, seed=1)
    random_adapter(model, SNAP_B, seed=2)
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir)
    prompt = tokens(7, 3 * BLOCK + 3)
    results(cached, [task("base", prompt, max_tokens=4, seed=5)])
    for slot in (SNAP_A, SNAP_B):
        t = [task(f"s{slot}", prompt, slot=slot, max_tokens=4, seed=5)]
        got = results(cached, t)
        assert_same(got, results(plain, [task(f"s{slot}", prompt, slot=slot, max_tokens=4, seed=5)]))
        assert got[f"s{slot}"].prompt_cache_hit_tokens == 0
    # together in one batch: no sharing of the prefill across adapters either
    mixed = [task(f"m{s}", prompt, slot=s, max_tokens=4, seed=5) for s in (None, SNAP_A, SNAP_B)]
    got = results(cached, mixed)
    slots = (None, SNAP_A, SNAP_B)
    assert_same(got, results(plain, [task(f"m{s}", prompt, slot=s, max_tokens=4, seed=5) for s in slots]))
    # each its own earlier entries: blocks, tail and last logits, the whole prompt
    assert all(r.prompt_cache_hit_tokens == len(prompt) for r in got.values())


def test_eviction_under_a_tiny_budget_keeps_results_exact(qwen3_dir):
    model = fresh_model(qwen3_dir)
    cfg = model.config
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * BLOCK * cfg.head_dim * 4
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir, prefix_cache_bytes=3 * block_bytes)
    _, prompts = multi_turn(11)
    others = [tokens(50 + i, 2 * BLOCK + 1) for i in range(3)]
    want = results(plain, requests(prompts + others, "e"))
    for _ in range(2):
        for i, p in enumerate(prompts + others):
            got = results(cached, [task(f"e{i}", p, max_tokens=6, seed=100 + i)])
            assert_same(got, {f"e{i}": want[f"e{i}"]})
            assert cached.prefix.bytes <= 3 * block_bytes
    assert cached.prefix.stats["evicted_blocks"] > 0 and cached.prefix.stats["hit_tokens"] > 0


def test_prompt_logprobs_requests_compute_the_whole_prompt(qwen3_dir):
    model = fresh_model(qwen3_dir)
    plain = make_sampler(model, qwen3_dir, prefix_cache_bytes=0)
    cached = make_sampler(model, qwen3_dir)
    system, prompts = multi_turn(13)
    results(cached, requests([system], "warm"))
    kw = dict(prompt_logprobs=True, topk_prompt_logprobs=3)
    got = results(cached, requests(prompts, "p", **kw))
    want = results(plain, requests(prompts, "p", **kw))
    assert_same(got, want)
    for k in want:
        np.testing.assert_allclose(got[k].topk_prompt_logprobs, want[k].topk_prompt_logprobs, atol=TOL, rtol=0)
    assert all(r.prompt_cache_hit_tokens == 0 for r in got.values())


def test_a_model_without_prefix_reuse_keeps_nothing(qwen3_dir, monkeypatch):
    model = fresh_model(qwen3_dir)
    monkeypatch.setattr(type(model), "supports_prefix_reuse", False)
    sampler = make_sampler(model, qwen3_dir)
    prompt = tokens(1, 3 * BLOCK)
    results(sampler, [task("a", prompt, max_tokens=2)])
    res = results(sampler, [task("b", prompt, max_tokens=2)])
    assert len(sampler.prefix) == 0 and res["b"].prompt_cache_hit_tokens == 0


def test_lru_keeps_the_first_blocks_of_a_chain_longest():
    """Evicting the least recently used block never strands a later block of its chain, and a
    prompt reads its longest cached prefix."""
    kv = torch.arange(2 * 1 * 2 * 4 * BLOCK * 1, dtype=torch.float32).view(2, 2, 1, 4 * BLOCK, 1)
    block_bytes = kv[:, :, :, :BLOCK].numel() * 4
    cache = PrefixCache(3 * block_bytes)
    a = list(range(4 * BLOCK))
    cache.insert("w", a, kv)  # four blocks, budget of three: the last one goes
    assert len(cache) == 3 and cache.stats["evicted_blocks"] == 1
    got = cache.lookup("w", a + [1], len(a))
    assert len(got) == 3
    torch.testing.assert_close(torch.cat([e.kv for e in got], dim=3), kv[:, :, :, : 3 * BLOCK])
    b = a[:BLOCK] + [7] * BLOCK  # shares the first block only
    assert len(cache.lookup("w", b, len(b))) == 1
    assert cache.lookup("other weights", a, len(a)) == []
    cache.insert("w", b, kv[:, :, :, BLOCK: 2 * BLOCK], start=BLOCK)
    # a's third block was least recently used; its first block (shared) stays
    assert len(cache.lookup("w", a, len(a))) == 2 and len(cache.lookup("w", b, len(b))) == 2


def test_admission_waits_for_kv_room_and_never_overruns_it(qwen3_dir):
    """With a K/V budget of two rows at their longest, requests queue (none fails) until rows
    finish; the buffers never outgrow the budget; results equal those of an unbounded sampler;
    a request that could never fit fails alone with a message."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 64 * cfg.head_dim * 4  # one row of 64 positions
    budget = 2 * row_bytes
    bounded = make_sampler(model, qwen3_dir, kv_cache_bytes=budget)
    free = make_sampler(model, qwen3_dir, kv_cache_bytes=0)
    make = lambda: [task(f"k{i}", tokens(i, 10 + i), max_tokens=20 + i, seed=i) for i in range(6)] + [
        task("too-big", tokens(9, 10), n=3, max_tokens=20, seed=9)]
    tasks = make()
    for t in tasks:
        bounded.add(t)
    out: dict = {}
    peak = 0
    while bounded.has_work():  # one scheduler step at a time: rows are counted between decode steps
        out.update(scheduler_steps(bounded, 1))
        peak = max(peak, len(bounded.rows))
        assert bounded.cache.nbytes() <= budget
    assert peak == 2
    assert "sequences of up to 30 tokens need" in str(out.pop("too-big"))
    want = run(free, make()[:-1])
    assert_same(out, want)
    assert len(free.rows) == 0 and free.stats["decode_steps"] < bounded.stats["decode_steps"]


def test_image_prompts_neither_read_nor_fill_the_cache(tmp_path_factory):
    """On Qwen3-VL, text prompts reuse blocks; a prompt with an image computes itself whole (its
    K/V depend on the image and its positions on the image's grid), equal to a sampler without
    a cache, even when its text before the image is cached."""
    from tests.conftest import SMALL
    from tests.models.test_qwen3_vl import image
    from tinsmith.devtools.tiny_model import make_tiny_model
    from tinsmith.models.loading import load_model
    from tinsmith.models.vision import expand_tokens
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import ImageInput, SampleInput, SamplingParams

    vl_dir = make_tiny_model(tmp_path_factory.mktemp("vl") / "qwen3_vl", "qwen3_vl", SMALL, seed=3)
    loaded = load_model(str(vl_dir))
    vt, vcfg = loaded.vision, loaded.config.vision
    head = tokens(21, 2 * BLOCK + 4)
    text = np.array(head + [vcfg.vision_start_token_id] + tokens(22, 5), dtype=np.int64)
    im = image(70, 50, position=len(head) + 1, seed=1)
    expanded, starts = expand_tokens(text, [im], [vt.num_tokens(im.width, im.height)], vcfg.image_token_id)
    placed = [ImageInput(**{**im.__dict__, "position": starts[0]})]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)

    def go(sampler):
        out = {}
        for key, inp in [("text", SampleInput(np.asarray(head + tokens(23, 9)), 1, params)),
                         ("text again", SampleInput(np.asarray(head + tokens(24, 3)), 1, params)),
                         ("image", SampleInput(np.asarray(expanded), 2, params, prompt_images=placed))]:
            out.update(results(sampler, [SampleTask(key, None, inp)]))
        return out

    plain = go(Sampler(loaded.model, lambda t: "", vision=vt, prefix_cache_bytes=0))
    cached_sampler = Sampler(loaded.model, lambda t: "", vision=vt)
    got = go(cached_sampler)
    assert_same(got, plain)
    assert got["text again"].prompt_cache_hit_tokens == 2 * BLOCK
    assert got["image"].prompt_cache_hit_tokens == 0


def test_hybrid_models_share_a_prompt_admitted_together_but_keep_no_blocks(qwen3_5_dir):
    """Qwen3.5 keeps a recurrent state the K/V blocks cannot restore, so nothing is kept across
    admissions; equal prompts admitted together still share one prefill (the state of the whole
    prompt is what each row needs), with the results of prefilling each on its own."""
    prompt = tokens(2, 2 * BLOCK + 3)
    tasks = [task(f"r{i}", prompt, max_tokens=5, temperature=1.0, seed=i, stop=[]) for i in range(3)]
    shared = make_sampler(fresh_model(qwen3_5_dir), qwen3_5_dir)
    got = results(shared, tasks)
    alone = make_sampler(fresh_model(qwen3_5_dir), qwen3_5_dir, prefix_cache_bytes=0)
    want = results(alone, [task(f"r{i}", prompt, max_tokens=5, temperature=1.0, seed=i, stop=[]) for i in range(3)])
    assert shared.stats["prefills"] == 1 and alone.stats["prefills"] == 3
    assert len(shared.prefix) == 0
    assert_same(got, want)


def _image_prompt(loaded, text_seed: int, image_seed: int):
    """Text, an image, text: the expanded prompt tokens and the image placed at its tokens."""
    from tests.models.test_qwen3_vl import image
    from tinsmith.models.vision import expand_tokens
    from tinsmith.types import ImageInput

    vt, vcfg = loaded.vision, loaded.config.vision
    text = np.array(tokens(text_seed, 6) + [vcfg.vision_start_token_id] + tokens(text_seed + 1, 4), dtype=np.int64)
    im = image(96, 64, position=7, seed=image_seed)  # 3 x 2 merged patches: the rope delta is -3
    expanded, starts = expand_tokens(text, [im], [vt.num_tokens(im.width, im.height)], vcfg.image_token_id)
    return np.asarray(expanded), [ImageInput(**{**im.__dict__, "position": starts[0]})]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_vl"])
def test_separate_requests_of_one_image_prompt_share_its_prefill(family, request):
    """GRPO's separate requests of one prompt with an image, admitted together: one prefill, its
    image encoded once, each request's result that of running it alone; an equal prompt with
    another image is prefilled on its own; a later admission of the prompt (requests arriving
    over several scheduler steps) seeds its rows from the kept prefill and its rope delta, and
    an adapter's request of it (other weights) computes it again."""
    from tinsmith.models.loading import load_model
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    loaded = load_model(str(request.getfixturevalue(f"{family}_dir")))
    prompt, images = _image_prompt(loaded, 1, image_seed=1)
    _, other = _image_prompt(loaded, 1, image_seed=2)

    def tasks(tag: str) -> list:
        out = [SampleTask(f"{tag}{i}", None, SampleInput(prompt, 1, SamplingParams(max_tokens=5, temperature=1.0,
                                                                                   seed=i, stop=[]),
                                                         prompt_images=images)) for i in range(4)]
        out.append(SampleTask(f"{tag}other", None, SampleInput(prompt, 1, SamplingParams(max_tokens=5, temperature=1.0,
                                                                                         seed=0, stop=[]),
                                                               prompt_images=other)))
        return out

    want = {}
    for t in tasks("r"):
        want.update(results(Sampler(loaded.model, lambda ids: "", vision=loaded.vision), [t]))
    sampler = Sampler(loaded.model, lambda ids: "", vision=loaded.vision)
    encoded = []
    encode = loaded.vision.encode
    loaded.vision.encode = lambda ims: encoded.append(len(ims)) or encode(ims)
    try:
        got = results(sampler, tasks("r"))
        assert_same(got, want)
        assert sampler.stats["prefills"] == 2 and sum(encoded) == 2
        assert got["r0"].sequences[0].tokens.tolist() != got["r1"].sequences[0].tokens.tolist()  # really sampled
        assert got["r0"].sequences[0].tokens.tolist() != got["rother"].sequences[0].tokens.tolist()
        again = results(sampler, tasks("r")[:1])
        assert_same(again, {"r0": want["r0"]})
        assert sampler.stats["prefills"] == 2 and sum(encoded) == 2
        assert again["r0"].prompt_cache_hit_tokens == len(prompt)
        random_adapter(loaded.model, SNAP_A, seed=3)
        results(sampler, [SampleTask(t.key, SNAP_A, t.input) for t in tasks("a")[:1]])
        assert sampler.stats["prefills"] == 3 and sum(encoded) == 3
    finally:
        loaded.vision.encode = encode


def test_text_prompts_queued_with_an_image_prompt_still_read_the_cache(qwen3_vl_dir):
    """A prefill with an image prompt computes every prompt whole, so text prompts queued beside
    one are admitted in a prefill of their own, which reads the prefix cache."""
    from tinsmith.models.loading import load_model
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    loaded = load_model(str(qwen3_vl_dir))
    prompt, images = _image_prompt(loaded, 3, image_seed=1)
    head = tokens(30, 2 * BLOCK + 4)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])

    def batch() -> list:
        return [SampleTask("image", None, SampleInput(prompt, 1, params, prompt_images=images)),
                SampleTask("text", None, SampleInput(np.asarray(head + tokens(31, 5)), 1, params))]

    plain = Sampler(loaded.model, lambda ids: "", vision=loaded.vision, prefix_cache_bytes=0)
    want = results(plain, batch())
    sampler = Sampler(loaded.model, lambda ids: "", vision=loaded.vision)
    results(sampler, [SampleTask("warm", None, SampleInput(np.asarray(head + tokens(32, 3)), 1, params))])
    got = results(sampler, batch())
    assert_same(got, want)
    assert got["text"].prompt_cache_hit_tokens == 2 * BLOCK and got["image"].prompt_cache_hit_tokens == 0


def test_tails_taken_together_equal_tails_taken_one_by_one():
    """A dense prefill's tails (the K/V past each prompt's last full block) kept for all its prompts
    at once equal each prompt's taken alone: tails of several widths, an empty one (a prompt of whole
    blocks), a prompt's last position at the prefill's width."""
    from tinsmith.sampling.prompt_states import PromptSnapshot

    g = torch.Generator().manual_seed(3)
    kv = {layer: (torch.randn(4, 2, 70, 8, generator=g), torch.randn(4, 2, 70, 8, generator=g)) for layer in (0, 2, 3)}
    logits = torch.randn(4, 50, generator=g)
    prompts, starts, lengths = [3, 0, 1, 2], [64, 0, 64, 64], [70, 5, 64, 66]
    together = PromptSnapshot.tails_of(kv, prompts, [logits[i] for i in prompts], starts, lengths)
    for snap, i, s, n in zip(together, prompts, starts, lengths):
        alone = PromptSnapshot.tail_of(kv, i, logits[i], s, n)
        want = torch.stack([torch.stack((kv[layer][0][i, :, s:n], kv[layer][1][i, :, s:n])) for layer in sorted(kv)])
        assert snap.tail.shape == want.shape and torch.equal(snap.tail, want) and torch.equal(alone.tail, want)
        assert snap.tail.is_contiguous() and snap.nbytes == alone.nbytes
        assert (snap.start, snap.length) == (s, n) and torch.equal(snap.last_logits, logits[i])
