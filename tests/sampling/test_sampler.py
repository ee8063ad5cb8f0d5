"""The continuous-batching sampler on tiny models: exactness, randomness, stops, bad input, memory.

References: ``transformers`` ``generate`` for greedy decoding, and a plain full forward pass (no
KV cache; for adapters, over weights with the LoRA delta merged in) for every logprob.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from tests.sampling.conftest import (
    decoder,
    forward_logprobs,
    fresh_model,
    make_sampler,
    random_adapter,
    run,
    sample_one,
    task,
    training_adapters,
)
from tinsmith.errors import InvalidInputError
from tinsmith.models import grouped_lora, lora, moe
from tinsmith.models.lora import LoraLinear
from tinsmith.sampling import kv_cache
from tinsmith.sampling.logits import choose_tokens, uniforms
from tinsmith.sampling.sampler import TOPK_SENTINEL

SNAP_A, SNAP_B = 1_000_001, 1_000_002  # adapter slots as the worker numbers sampler snapshots
LP_TOL = 1e-4


def prompts(seed: int, lengths, vocab: int) -> list[list[int]]:
    """Random prompts of ordinary tokens (ids 0..3 are the tokenizer's special tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).tolist() for n in lengths]


def merged_copy(model, slot: int):
    """A copy of ``model`` whose base weights are W + scale * B A of ``slot``, with no adapters."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, LoraLinear):
                if slot in m.adapters:
                    m.weight = torch.nn.Parameter(m.merged_weight(slot), requires_grad=False)
                m.adapters = {}
    return ref


def check_logprobs_vs_forward(ref_model, prompt, seq, tol=LP_TOL, ref_slot=None):
    """Every sampled token's logprob equals the full forward pass over prompt + sampled tokens."""
    toks = list(prompt) + seq.tokens.tolist()
    lp = forward_logprobs(ref_model, toks, ref_slot)
    P = len(prompt)
    want = lp[P - 1 : len(toks) - 1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
    assert seq.logprobs.dtype == np.float32 and len(seq.logprobs) == len(seq.tokens)
    np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=tol, rtol=0)


def ok(res):
    assert not isinstance(res, Exception), res
    return res


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "qwen3_moe"])
def test_greedy_equals_transformers_generate(model_dirs, family, request):
    import transformers

    d = model_dirs[family] if family in model_dirs else request.getfixturevalue(f"{family}_dir")
    model = fresh_model(d)
    V = model.config.vocab_size
    ps = prompts(1, (1, 6, 19), V)
    new = 24
    # All prompts in one batch (different lengths share prefill and decode steps).
    res = run(make_sampler(model, d), [task(i, p, max_tokens=new, temperature=0.0, stop=[]) for i, p in enumerate(ps)])

    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as stop=[] does on our side
    for i, p in enumerate(ps):
        seq = ok(res[i]).sequences[0]
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=3)
            theirs = out[0, len(p):].tolist()
            hf_lp = torch.log_softmax(hf(out).logits[0].float(), -1)
        assert len(theirs) == new
        assert seq.tokens.tolist() == theirs, f"{family} prompt {i}"
        assert seq.stop_reason == "length"
        want = hf_lp[len(p) - 1 : -1].gather(-1, out[0, len(p):, None])[:, 0]
        np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=LP_TOL, rtol=0)


@pytest.mark.parametrize("grouped", [False, True], ids=["adapter-by-adapter", "grouped"])
def test_sampled_logprobs_equal_forward_base_and_adapters(qwen3_dir, grouped, monkeypatch):
    """``grouped``: the prefill's several adapters through the grouped matmul, as on a GPU (q/k/v
    and gate/up as one grouped shrink and expand over the pack), ranks 4 and 8 padded to one."""
    packs = []  # the packed projections' prefills of several adapters' prompts, grouped
    if grouped:
        monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
        applied = lora.tenants_group_applied
        monkeypatch.setattr(lora, "tenants_group_applied", lambda x, layers, *a, **kw: (
            packs.append(len(layers)), applied(x, layers, *a, **kw))[1])
    model = fresh_model(qwen3_dir)
    V = model.config.vocab_size
    random_adapter(model, SNAP_A, rank=4, seed=1)
    # Adapters made the way training runs make them (one only on the MLPs), B moved off zero.
    rt, unit, mlp_only = training_adapters(model)
    assert any(float(p.detach().abs().sum()) > 0 for n, p in rt.unit(unit).named_params if "lora_B" in n)

    ps = prompts(2, (5, 11, 3), V)
    cases = {  # key: (slot, prompt, sampling settings); every sequence decodes in one shared batch
        "base": (None, ps[0], dict(temperature=1.0, seed=1)),
        "snap": (SNAP_A, ps[1], dict(temperature=0.7, top_k=20, seed=2)),
        "train": (unit, ps[2], dict(temperature=1.3, top_p=0.9, seed=3)),
        "snap-greedy": (SNAP_A, ps[0], dict(temperature=0.0)),
        "mlp-only": (mlp_only, ps[1], dict(temperature=1.0, seed=4)),
    }
    tasks = [task(k, p, slot=s, n=2, max_tokens=20, stop=[], **kw) for k, (s, p, kw) in cases.items()]
    res = run(make_sampler(model, qwen3_dir), tasks)

    refs = {None: model, SNAP_A: merged_copy(model, SNAP_A), unit: merged_copy(model, unit),
            mlp_only: merged_copy(model, mlp_only)}
    # The adapters really change the model (otherwise this test would not test them).
    base_lp = forward_logprobs(model, ps[1])
    assert float((forward_logprobs(refs[SNAP_A], ps[1]) - base_lp).abs().max()) > 1e-2
    assert float((forward_logprobs(refs[unit], ps[1]) - base_lp).abs().max()) > 1e-2
    assert float((forward_logprobs(refs[mlp_only], ps[1]) - base_lp).abs().max()) > 1e-2
    for k, (slot, p, _) in cases.items():
        for seq in ok(res[k]).sequences:
            assert len(seq.tokens) == 20
            # Logprobs are the model's own (temperature 1, untruncated), whatever the sampling settings.
            check_logprobs_vs_forward(refs[slot], p, seq)
            check_logprobs_vs_forward(model, p, seq, ref_slot=slot)  # the segmented (prefill) path agrees too
    if grouped:  # every layer's q/k/v and gate/up
        assert sorted(set(packs)) == [2, 3] and len(packs) >= 2 * model.config.num_layers, packs


def test_a_prefill_of_several_adapters_prompts_costs_the_same_for_two_adapters_or_six(qwen3_dir, monkeypatch):
    """Where the grouped matmul runs (GPUs; forced here), a prefill of prompts over several adapters
    dispatches the same device operations (each a launch on a GPU, while decoding rows wait) for
    two adapters as for six: every projection takes one grouped shrink and expand for all of them,
    its stacks made in a few operations, not a pair of GEMMs and casts per adapter."""
    from bench.dispatch_micro import KernelOps  # operations that run a kernel (not views)

    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    model = fresh_model(qwen3_dir)
    for slot in range(1, 7):
        random_adapter(model, slot, rank=4, seed=slot)
    V = model.config.vocab_size
    counts = {}
    for adapters in (2, 6):
        sampler = make_sampler(model, qwen3_dir, max_rows=12, kv_layout="paged")
        ps = prompts(adapters, (9,) * 12, V)
        done: list = []
        with torch.inference_mode():
            for i, p in enumerate(ps):
                sampler.add(task(i, p, slot=1 + i % adapters, max_tokens=4, temperature=1.0, seed=i, stop=[]))
            sampler.cache.ensure(12, 16)
            sampler.cache._make_free(40)  # no pool growth inside the counted admission
            for cached in (grouped_lora.group_offsets, grouped_lora.own_columns, grouped_lora._group_scales):
                cached.cache_clear()  # each count pays its layout's uploads, whatever earlier tests left cached
            ops = KernelOps()
            with ops:
                sampler._admit(done)
        assert not done and len(sampler.rows) == 12
        counts[adapters] = ops.ops
    assert counts[6] == counts[2], counts[6] - counts[2]


# ------------------------------------------------------------------------------------ randomness
def test_seeded_request_is_reproducible(qwen3_dir):
    model = fresh_model(qwen3_dir)
    (p,) = prompts(3, (7,), model.config.vocab_size)
    a = sample_one(make_sampler(model, qwen3_dir), p, n=3, max_tokens=24, stop=[], seed=42)
    b = sample_one(make_sampler(model, qwen3_dir), p, n=3, max_tokens=24, stop=[], seed=42)
    for x, y in zip(a.sequences, b.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # Seeds beyond 64 bits and negative seeds are accepted (the SDK allows any integer).
    for seed in (-1, (1 << 64) - 1, 1 << 70):
        s = sample_one(make_sampler(model, qwen3_dir), p, max_tokens=4, stop=[], seed=seed)
        assert len(s.sequences[0].tokens) == 4


def _step_until(sampler, decode_steps: int, done: dict) -> None:
    target = sampler.stats["decode_steps"] + decode_steps
    while sampler.stats["decode_steps"] < target and sampler.has_work():
        for k, r in sampler.step(1e-4):
            done[k] = r


def test_seeded_request_unchanged_by_batch_company(qwen3_dir):
    """A seeded request samples the same tokens alone, admitted with others, or joining mid-way."""
    model = fresh_model(qwen3_dir)
    random_adapter(model, SNAP_A, seed=11)
    random_adapter(model, SNAP_B, seed=12)
    V = model.config.vocab_size
    p_seeded, p1, p2, p3, p4 = prompts(4, (9, 3, 17, 30, 1), V)

    def seeded():
        return task("seeded", p_seeded, slot=SNAP_A, n=3, max_tokens=32, stop=[], temperature=1.0, seed=1234)

    def company(tag):
        return [
            task(f"{tag}-base", p1, n=2, max_tokens=40, stop=[], temperature=1.0),
            task(f"{tag}-b", p2, slot=SNAP_B, max_tokens=12, stop=[], temperature=0.8, seed=5),
            task(f"{tag}-a", p_seeded, slot=SNAP_A, max_tokens=50, stop=[], temperature=1.0, seed=99),
            task(f"{tag}-greedy", p3, slot=SNAP_B, max_tokens=8, stop=[], temperature=0.0),
        ]

    alone = ok(run(make_sampler(model, qwen3_dir), [seeded()])["seeded"]).sequences

    # 1. admitted in the same step as requests of other adapters and lengths
    together = ok(run(make_sampler(model, qwen3_dir), [*company("x"), seeded()])["seeded"]).sequences

    # 2. joining a batch that is already decoding, and others joining while it decodes
    s = make_sampler(model, qwen3_dir)
    done: dict = {}
    for t in company("y"):
        s.add(t)
    _step_until(s, 5, done)
    assert s.rows, "the batch should still be decoding when the seeded request joins"
    s.add(seeded())
    _step_until(s, 7, done)
    assert "seeded" not in done and any(r.state.task.key == "seeded" for r in s.rows)
    for t in company("z"):
        s.add(t)
    s.add(task("late", p4, max_tokens=20, stop=[], temperature=1.0))
    done.update(run(s, []))
    midway = ok(done["seeded"]).sequences

    for variant in (together, midway):
        for x, y in zip(alone, variant):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(q.tokens.tolist()) for q in alone}) == 3, "copies of one request should differ"


def test_different_seeds_and_copies_differ(qwen3_dir):
    model = fresh_model(qwen3_dir)
    (p,) = prompts(5, (6,), model.config.vocab_size)
    s = make_sampler(model, qwen3_dir)
    kw = dict(max_tokens=16, stop=[], temperature=1.0)
    res = run(s, [task("s1", p, seed=1, **kw), task("s2", p, seed=2, **kw), task("copies", p, n=6, seed=3, **kw),
                  task("u1", p, **kw), task("u2", p, **kw)])
    toks = {k: [tuple(q.tokens.tolist()) for q in ok(r).sequences] for k, r in res.items()}
    assert toks["s1"] != toks["s2"]
    assert len(set(toks["copies"])) == 6
    assert toks["u1"] != toks["u2"], "unseeded requests must not share a seed"


def test_choose_tokens_follows_the_truncated_distribution():
    """Token frequencies over many rows match softmax(logits / T) restricted by top-k / top-p."""
    torch.manual_seed(0)
    V, N = 24, 120_000
    base = torch.randn(V) * 2.0
    u = uniforms(torch.full((N,), 77, dtype=torch.long), torch.arange(N), torch.zeros(N, dtype=torch.long))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005

    def expected(T, k, p):
        probs = torch.softmax(base.double() / T, -1)
        order = torch.argsort(probs, descending=True)
        keep = torch.zeros(V, dtype=torch.bool)
        mass = 0.0
        for rank, i in enumerate(order.tolist()):
            if (k > 0 and rank >= k) or (rank > 0 and mass >= p):
                break
            keep[i] = True
            mass += float(probs[i])
        out = torch.where(keep, probs, torch.zeros_like(probs))
        return out / out.sum()

    for T, k, p in [(1.0, -1, 1.0), (0.5, -1, 1.0), (2.0, 5, 1.0), (1.0, -1, 0.6), (0.8, 4, 0.7)]:
        tok, lp, _ = choose_tokens(base.expand(N, V), torch.full((N,), T), torch.full((N,), k),
                                      torch.full((N,), p), u)
        freq = torch.bincount(tok, minlength=V).double() / N
        want = expected(T, k, p)
        assert bool((freq[want == 0] == 0).all()), f"T={T} k={k} p={p}: sampled a truncated token"
        sigma = torch.sqrt(want * (1 - want) / N)
        z = float(((freq - want).abs() / sigma.clamp_min(1e-12))[want > 0].max())
        assert z < 5.0, f"T={T} k={k} p={p}: frequencies off by {z:.1f} sigma"
        # returned logprobs are the untempered, untruncated model logprobs of the chosen tokens
        np.testing.assert_allclose(lp.numpy(), torch.log_softmax(base, -1)[tok].numpy(), atol=1e-6)


def test_greedy_limits_agree(qwen3_dir):
    """top_k=1, a tiny top_p and tiny temperatures all sample the greedy tokens (never NaN)."""
    model = fresh_model(qwen3_dir)
    random_adapter(model, SNAP_A, seed=3)
    ps = prompts(6, (4, 13), model.config.vocab_size)
    variants = {
        "greedy": dict(temperature=0.0),
        "greedy-with-limits": dict(temperature=0.0, top_k=3, top_p=0.5),
        "top_k=1": dict(temperature=1.0, top_k=1, seed=1),
        "top_p tiny": dict(temperature=1.5, top_p=1e-6, seed=2),
        "T=1e-3": dict(temperature=1e-3, seed=3),
        "T=1e-30": dict(temperature=1e-30, seed=4),
        "T=1e-44": dict(temperature=1e-44, seed=5),  # a float32 denormal: logits / T overflows
    }
    tasks = [task((name, i, slot), p, slot=slot, max_tokens=16, stop=[], **kw)
             for name, kw in variants.items() for i, p in enumerate(ps) for slot in (None, SNAP_A)]
    res = run(make_sampler(model, qwen3_dir), tasks)
    for (name, i, slot), r in res.items():
        seq = ok(r).sequences[0]
        greedy = ok(res[("greedy", i, slot)]).sequences[0]
        assert np.isfinite(seq.logprobs).all(), name
        assert seq.tokens.tolist() == greedy.tokens.tolist(), f"{name} differs from greedy (prompt {i}, slot {slot})"
        np.testing.assert_allclose(seq.logprobs, greedy.logprobs, atol=1e-5)


# ------------------------------------------------------------------------------------ stops
def _greedy_ref(model, model_dir, p, n=24, slot=None):
    return ok(sample_one(make_sampler(model, model_dir), p, slot=slot, max_tokens=n, stop=[], temperature=0.0)).sequences[0]


def _first_new(tokens: list[int], start: int, avoid=()) -> int:
    """Index of the first position >= start whose token does not occur earlier (nor in avoid)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid:
            return i
    raise AssertionError(f"no fresh token after {start} in {tokens}")


def test_stop_token_ids(qwen3_dir):
    model = fresh_model(qwen3_dir)
    eos = model.config.eos_token_ids
    (p,) = prompts(7, (5,), model.config.vocab_size)
    ref = _greedy_ref(model, qwen3_dir, p).tokens.tolist()
    assert not set(ref) & set(eos)
    i = _first_new(ref, 3)
    j = _first_new(ref, i + 1)
    s = make_sampler(model, qwen3_dir)
    res = run(s, [task("one", p, max_tokens=24, temperature=0.0, stop=[ref[i]]),
                  task("two", p, max_tokens=24, temperature=0.0, stop=[ref[j], ref[i]]),
                  task("late", p, max_tokens=24, temperature=0.0, stop=[ref[j]]),
                  task("first", p, max_tokens=24, temperature=0.0, stop=[ref[0]])])
    for key, end in (("one", i + 1), ("two", i + 1), ("late", j + 1), ("first", 1)):
        seq = ok(res[key]).sequences[0]
        assert seq.tokens.tolist() == ref[:end], key  # stops at the first stop token, which is included
        assert seq.stop_reason == "stop", key
        assert len(seq.logprobs) == end


def test_eos_ends_a_sequence_unless_stop_is_empty(qwen3_dir):
    model = fresh_model(qwen3_dir)
    (p,) = prompts(8, (5,), model.config.vocab_size)
    ref = _greedy_ref(model, qwen3_dir, p).tokens.tolist()
    i = _first_new(ref, 4)
    # Make a token the greedy run emits at position i the model's EOS.
    model.config = dataclasses.replace(model.config, eos_token_ids=(ref[i],))
    other = next(t for t in range(4, 500) if t not in ref)
    s = make_sampler(model, qwen3_dir)
    res = run(s, [
        task("default", p, max_tokens=24, temperature=0.0),
        task("ids", p, max_tokens=24, temperature=0.0, stop=[other]),
        task("strings", p, max_tokens=24, temperature=0.0, stop=["\x07never\x07"]),
        task("empty", p, max_tokens=24, temperature=0.0, stop=[]),
        task("short", p, max_tokens=i, temperature=0.0),
    ])
    for key in ("default", "ids", "strings"):
        seq = ok(res[key]).sequences[0]
        assert seq.tokens.tolist() == ref[: i + 1] and seq.stop_reason == "stop", key
    empty = ok(res["empty"]).sequences[0]
    assert empty.tokens.tolist() == ref and empty.stop_reason == "length"
    short = ok(res["short"]).sequences[0]
    assert short.tokens.tolist() == ref[:i] and short.stop_reason == "length"


def test_stop_string_spanning_two_tokens(qwen3_dir):
    model = fresh_model(qwen3_dir)
    dec = decoder(qwen3_dir)
    V = model.config.vocab_size
    found = None
    for seed in range(10):
        (p,) = prompts(100 + seed, (6,), V)
        ref = _greedy_ref(model, qwen3_dir, p, n=40).tokens.tolist()
        for i in range(1, len(ref) - 1):
            a, b = dec([ref[i]]), dec([ref[i + 1]])
            if not (len(a) >= 2 and b and (a + b).isascii() and (a + b).isprintable()):
                continue
            stop = a[-2:] + b  # ends inside neither token alone
            upto = dec(ref[: i + 2])
            if upto.endswith(stop) and upto.count(stop) == 1 and stop not in a and stop not in b:
                found = (p, ref, i + 2, stop)
                break
        if found:
            break
    assert found, "no greedy output with a stop string across a token boundary"
    p, ref, end, stop = found
    s = make_sampler(model, qwen3_dir)
    res = run(s, [task("str", p, max_tokens=40, temperature=0.0, stop=[stop]),
                  task("str+never", p, max_tokens=40, temperature=0.0, stop=["\x07zz\x07", stop]),
                  task("n2", p, n=2, max_tokens=40, temperature=0.0, stop=[stop])])
    for key, r in res.items():
        for seq in ok(r).sequences:
            assert seq.stop_reason == "stop", key
            assert seq.tokens.tolist() == ref[:end], key  # ends at the token that completes the string
            text = dec(seq.tokens.tolist())
            assert text.endswith(stop) and text.count(stop) == 1, (key, text, stop)
            assert stop not in dec(seq.tokens.tolist()[:-1])


def test_max_tokens_reached_is_length(qwen3_dir):
    model = fresh_model(qwen3_dir)
    (p,) = prompts(9, (5,), model.config.vocab_size)
    res = run(make_sampler(model, qwen3_dir), [task(n, p, n=2, max_tokens=n, stop=[], temperature=1.0, seed=n)
                                              for n in (1, 2, 7, 65)])
    for n, r in res.items():
        for seq in ok(r).sequences:
            assert len(seq.tokens) == n == len(seq.logprobs)
            assert seq.stop_reason == "length"
            assert seq.tokens.dtype == np.int32


# ------------------------------------------------------------------------------------ prompt logprobs
@pytest.mark.parametrize("slot", [None, SNAP_A])
def test_prompt_logprobs(qwen3_dir, slot):
    model = fresh_model(qwen3_dir)
    random_adapter(model, SNAP_A, seed=21)
    (p,) = prompts(10, (12,), model.config.vocab_size)
    P, k = len(p), 5
    res = run(make_sampler(model, qwen3_dir), [
        task("all", p, slot=slot, max_tokens=1, temperature=0.0, prompt_logprobs=True),
        task("last4", p, slot=slot, max_tokens=1, temperature=0.0, prompt_logprobs=True, prompt_logprobs_last_n=4),
        task("topk", p, slot=slot, max_tokens=6, stop=[], temperature=0.0, prompt_logprobs=True,
             topk_prompt_logprobs=k, topk_sample_logprobs=3),
        task("one-token", p[:1], slot=slot, max_tokens=2, stop=[], temperature=0.0, prompt_logprobs=True,
             topk_prompt_logprobs=2),
        task("none", p, slot=slot, max_tokens=2, temperature=0.0),
    ])
    ref = merged_copy(model, slot) if slot is not None else model
    lp = forward_logprobs(ref, p)
    want = lp[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0].numpy()

    full = ok(res["all"]).prompt_logprobs
    assert full.shape == (P,) and full.dtype == np.float32
    assert np.isnan(full[0]) and not np.isnan(full[1:]).any()
    np.testing.assert_allclose(full[1:], want, atol=LP_TOL, rtol=0)

    last = ok(res["last4"]).prompt_logprobs
    assert last.shape == (P,)
    assert np.isnan(last[: P - 4]).all() and not np.isnan(last[P - 4 :]).any()
    np.testing.assert_allclose(last[P - 4 :], want[-4:], atol=LP_TOL, rtol=0)

    r = ok(res["topk"])
    ids, vals = r.topk_prompt_token_ids, r.topk_prompt_logprobs
    assert ids.shape == (P, k) and vals.shape == (P, k)
    assert (ids[0] == 0).all() and (vals[0] == TOPK_SENTINEL).all()
    assert (np.diff(vals[1:], axis=1) <= 0).all(), "top-k rows must be in descending order"
    top = torch.topk(lp[:-1], k, dim=-1)
    np.testing.assert_array_equal(ids[1:], top.indices.numpy())
    np.testing.assert_allclose(vals[1:], top.values.numpy(), atol=LP_TOL, rtol=0)
    np.testing.assert_allclose(r.prompt_logprobs[1:], want, atol=LP_TOL, rtol=0)
    for seq in r.sequences:
        assert seq.topk_token_ids.shape == (6, 3) and seq.topk_logprobs.shape == (6, 3)
        np.testing.assert_array_equal(seq.topk_token_ids[:, 0], seq.tokens)  # greedy: top-1 is the sample
        np.testing.assert_allclose(seq.topk_logprobs[:, 0], seq.logprobs, atol=1e-6)
        assert (np.diff(seq.topk_logprobs, axis=1) <= 0).all()
        assert all(len(set(row)) == 3 for row in seq.topk_token_ids.tolist())

    one = ok(res["one-token"])
    assert one.prompt_logprobs.shape == (1,) and np.isnan(one.prompt_logprobs[0])
    assert one.topk_prompt_token_ids.shape == (1, 2) and (one.topk_prompt_logprobs == TOPK_SENTINEL).all()

    none = ok(res["none"])
    assert none.prompt_logprobs is None and none.topk_prompt_logprobs is None
    assert none.sequences[0].topk_token_ids is None


def test_scoring_call_runs_no_decode_step(sampler, qwen3_model):
    (p,) = prompts(11, (20,), qwen3_model.config.vocab_size)
    sample_one(sampler, p, max_tokens=4, stop=[])  # warm state: the counters move for real work
    steps, prefills = sampler.stats["decode_steps"], sampler.stats["prefills"]
    r = sample_one(sampler, p, max_tokens=1, temperature=0.0, prompt_logprobs=True)
    assert sampler.stats["decode_steps"] == steps, "max_tokens=1 must be answered from the prefill alone"
    assert sampler.stats["prefills"] == prefills + 1
    assert len(r.sequences[0].tokens) == 1 and r.sequences[0].stop_reason in ("length", "stop")
    assert not np.isnan(r.prompt_logprobs[1:]).any()
    assert not sampler.rows and not sampler.has_work()


# ------------------------------------------------------------------------------------ bad input
def test_bad_input_fails_only_its_own_task(qwen3_dir):
    model = fresh_model(qwen3_dir)
    random_adapter(model, SNAP_A, seed=31)
    V, ctx = model.config.vocab_size, model.config.max_position_embeddings
    (p,) = prompts(12, (6,), V)
    s = make_sampler(model, qwen3_dir, max_rows=16)
    good = dict(max_tokens=10, stop=[], temperature=1.0, seed=7)
    bad = {
        "empty prompt": (task("empty prompt", [], max_tokens=4), "prompt"),
        "token >= vocab": (task("token >= vocab", [5, V, 6], max_tokens=4), "prompt"),
        "negative token": (task("negative token", [5, -1, 6], max_tokens=4), "prompt"),
        "max_tokens=0": (task("max_tokens=0", p, max_tokens=0), "max_tokens"),
        "max_tokens<0": (task("max_tokens<0", p, max_tokens=-5), "max_tokens"),
        "beyond context": (task("beyond context", p, max_tokens=ctx - len(p) + 1), "max_tokens"),
        "top_p=0": (task("top_p=0", p, max_tokens=4, top_p=0.0), "top_p"),
        "top_p=1.5": (task("top_p=1.5", p, max_tokens=4, top_p=1.5), "top_p"),
        "temperature<0": (task("temperature<0", p, max_tokens=4, temperature=-0.5), "temperature"),
        "temperature nan": (task("temperature nan", p, max_tokens=4, temperature=float("nan")), "temperature"),
        "num_samples=0": (task("num_samples=0", p, n=0, max_tokens=4), "num_samples"),
        "num_samples>rows": (task("num_samples>rows", p, n=17, max_tokens=4), "num_samples"),
        "stop id >= vocab": (task("stop id >= vocab", p, max_tokens=4, stop=[V + 3]), "stop"),
        "topk sample huge": (task("topk sample huge", p, max_tokens=4, topk_sample_logprobs=10**9),
                             "topk_sample_logprobs"),
        "topk prompt huge": (task("topk prompt huge", p, max_tokens=1, prompt_logprobs=True,
                                  topk_prompt_logprobs=10**9), "topk_prompt_logprobs"),
    }
    tasks = [task("good-before", p, **good)] + [t for t, _ in bad.values()] + [task("good-after", p, slot=SNAP_A, **good)]
    res = run(s, tasks, max_steps=500)
    for key, (_, field) in bad.items():
        assert isinstance(res[key], InvalidInputError), (key, res[key])
        assert field in res[key].message, (key, res[key].message)
    alone_before = sample_one(make_sampler(model, qwen3_dir), p, **good)
    alone_after = sample_one(make_sampler(model, qwen3_dir), p, slot=SNAP_A, **good)
    for key, alone in (("good-before", alone_before), ("good-after", alone_after)):
        np.testing.assert_array_equal(ok(res[key]).sequences[0].tokens, alone.sequences[0].tokens)
    # the largest request that fits is accepted
    fits = sample_one(s, [5], n=16, max_tokens=ctx - 1, stop=[int(t) for t in range(V)])  # every token stops it
    assert all(len(q.tokens) == 1 and q.stop_reason == "stop" for q in fits.sequences)


# ------------------------------------------------------------------------------------ KV cache
def test_kv_cache_grows_by_blocks_and_rows_are_reused(qwen3_dir):
    model = fresh_model(qwen3_dir)
    (p,) = prompts(13, (10,), model.config.vocab_size)
    s = make_sampler(model, qwen3_dir)
    ctx = model.config.max_position_embeddings
    ref = _greedy_ref(model, qwen3_dir, p, n=12).tokens.tolist()
    stop_at = _first_new(ref, 4)

    # max_tokens = the whole context, but the sequence stops after a few tokens: nothing is sized for it
    r = sample_one(s, p, n=4, max_tokens=ctx - len(p), temperature=0.0, stop=[ref[stop_at]])
    assert all(len(q.tokens) == stop_at + 1 for q in r.sequences)
    assert s.cache.capacity == kv_cache.BLOCK
    assert s.cache.row_capacity == 8

    # A long request: while it runs, the cache holds only what has been generated, in blocks.
    s.add(task("long", p, max_tokens=400, stop=[], temperature=1.0, seed=1))
    seen = set()
    done: dict = {}
    while s.has_work():
        for k, res in s.step(2e-3):
            done[k] = res
        if s.rows:
            n_held = int(s.cache.lengths[0])
            cap = s.cache.capacity
            assert cap % kv_cache.BLOCK == 0 and n_held <= cap <= n_held + 2 * kv_cache.BLOCK, (cap, n_held)
            seen.add(cap)
    assert len(ok(done["long"]).sequences[0].tokens) == 400
    assert max(seen) <= len(p) + 400 + kv_cache.BLOCK and len(seen) >= 3, seen
    assert s.cache.capacity == kv_cache.BLOCK, "memory is given back when the batch empties"

    # Many short requests in waves: rows are recycled, the row buffers do not keep growing.
    for wave in range(3):
        res = run(s, [task((wave, i), p, max_tokens=3 + i, stop=[], temperature=1.0) for i in range(6)])
        assert all(len(ok(r).sequences[0].tokens) == 3 + i for (_, i), r in res.items())
        assert s.cache.row_capacity == 8
    res = run(s, [task(("wide", i), p, n=4, max_tokens=5, stop=[]) for i in range(10)])
    assert s.cache.row_capacity == 8, "40 rows' buffers are released once they finish"
    assert len(res) == 10


# ------------------------------------------------------------------------------------ failures
def test_an_unexpected_error_fails_its_requests_and_sampling_goes_on(qwen3_dir, monkeypatch):
    """An error that is not bad input (out of memory, say) fails the requests of the failing
    prefill or decode step; requests running beside them, and later ones, are unaffected."""
    model = fresh_model(qwen3_dir)
    ps = prompts(14, (5, 7, 9, 4), model.config.vocab_size)
    kw = dict(max_tokens=30, stop=[], temperature=1.0, seed=3)
    alone = [sample_one(make_sampler(model, qwen3_dir), p, **kw).sequences[0].tokens.tolist() for p in ps]

    s = make_sampler(model, qwen3_dir)
    real_plp, real_decode = s._prompt_logprobs, s._decode_step
    fail_decode = {"now": False}

    def prompt_logprobs(st, h):
        if st.task.key == "bad prefill":
            raise RuntimeError("simulated out of memory in prefill")
        return real_plp(st, h)

    def decode_step(done):
        if fail_decode["now"]:
            fail_decode["now"] = False
            raise RuntimeError("simulated out of memory in decode")
        return real_decode(done)

    monkeypatch.setattr(s, "_prompt_logprobs", prompt_logprobs)
    monkeypatch.setattr(s, "_decode_step", decode_step)
    done: dict = {}
    s.add(task("running", ps[0], **kw))
    _step_until(s, 3, done)
    s.add(task("bad prefill", ps[1], n=2, max_tokens=5, prompt_logprobs=True))
    _step_until(s, 3, done)
    assert isinstance(done.pop("bad prefill"), RuntimeError)
    assert [r.state.task.key for r in s.rows] == ["running"]
    s.add(task("after", ps[2], **kw))
    done.update(run(s, []))
    assert ok(done["running"]).sequences[0].tokens.tolist() == alone[0]
    assert ok(done["after"]).sequences[0].tokens.tolist() == alone[2]

    # a failing decode step fails the requests in the batch, not the sampler
    s.add(task("victim 1", ps[0], **kw))
    s.add(task("victim 2", ps[1], n=2, **kw))
    _step_until(s, 2, done)
    fail_decode["now"] = True
    for key, res in s.step(0.01):
        done[key] = res
    assert isinstance(done["victim 1"], RuntimeError) and isinstance(done["victim 2"], RuntimeError)
    assert not s.rows and not s.has_work()
    assert ok(run(s, [task("later", ps[3], **kw)])["later"]).sequences[0].tokens.tolist() == alone[3]


def test_abort_returns_every_queued_and_running_request(qwen3_dir):
    """What the engine relies on to fail, not strand, requests when a sampling slice breaks."""
    from tinsmith.models.loading import load_model as _load
    from tinsmith.sampling.sampler import SampleTask as _Task, Sampler as _Sampler
    from tinsmith.types import SampleInput as _In, SamplingParams as _P

    s = _Sampler(_load(str(qwen3_dir)).model, lambda ids: "")
    prompt = np.array([1, 2, 3])
    s.add(_Task("running", None, _In(prompt, 2, _P(max_tokens=50, stop=[]))))
    s.step(budget_s=0.0)  # admitted, not finished
    s.add(_Task("queued", None, _In(prompt, 1, _P(max_tokens=5))))
    assert sorted(s.abort()) == ["queued", "running"]
    assert not s.has_work()
