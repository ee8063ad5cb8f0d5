"""Requests of several API keys waiting for rows: admitted in turns, not in arrival order.

A key with hundreds of requests queued must not make another key's single request wait behind
all of them: each waiting request is placed at the row its key would reach with it (rows held
plus rows queued ahead of it), and the lowest place is admitted first.
"""

from __future__ import annotations

import pytest

from tests.sampling.conftest import fresh_model, make_sampler, run, scheduler_steps, task
from tests.sampling.test_prefix_cache import tokens


def owned(owner: str, key: str, seed: int, **kw):
    t = task(key, tokens(seed, 6), max_tokens=kw.pop("max_tokens", 4), seed=seed, stop=[], **kw)
    t.owner = owner
    return t


def admission_order(sampler) -> list:
    """Keys in the order the sampler admits them (validation is the first thing admission does)."""
    order: list = []
    validate = sampler._validate

    def recorded(t):
        order.append(t.key)
        return validate(t)

    sampler._validate = recorded
    return order


def test_a_single_request_does_not_wait_behind_another_keys_queue(qwen3_dir):
    sampler = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=4, prefix_cache_bytes=0)
    order = admission_order(sampler)
    busy = [owned("busy", f"busy{i}", i) for i in range(12)]
    out = run(sampler, busy + [owned("light", "light", 99)])
    assert not any(isinstance(r, Exception) for r in out.values())
    # Arrival order would admit it 13th, after three waves of the busy key's requests.
    assert order.index("light") == 1, order
    assert [k for k in order if k != "light"] == [f"busy{i}" for i in range(12)], "a key's own order is kept"
    # Every admission is counted with its wait for a row (later waves waited for earlier ones).
    assert sampler.stats["admissions"] == 13 and sampler.stats["admission_wait_s"] > 0


def test_rows_held_count_against_their_key(qwen3_dir):
    """The busy key holds every row and has more queued; as single rows free up, the key that
    holds none gets them, one after the other, while the busy key still holds three."""
    sampler = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=4, prefix_cache_bytes=0)
    order = admission_order(sampler)
    sampler.add(owned("busy", "busy0", 0, max_tokens=2))
    for i in range(1, 4):
        sampler.add(owned("busy", f"busy{i}", i, max_tokens=40))
    out = scheduler_steps(sampler, 1)  # the busy key's rows are decoding (busy0's ends at its second token)
    assert {r.state.task.key for r in sampler.rows} >= {"busy1", "busy2", "busy3"}
    for i in range(4, 8):
        sampler.add(owned("busy", f"busy{i}", i, max_tokens=3))
    for i in range(3):
        sampler.add(owned("light", f"light{i}", 50 + i, max_tokens=3))
    out.update(run(sampler, []))
    assert len(out) == 11 and not any(isinstance(r, Exception) for r in out.values())
    # In arrival order busy4 would take the first row that frees up (busy0's).
    assert order[4:] == ["light0", "light1", "light2", "busy4", "busy5", "busy6", "busy7"], order


def test_several_samples_count_as_several_rows(qwen3_dir):
    """A request of num_samples=3 places its key three rows on: the other key's next two
    single-row requests go before that key's next one."""
    sampler = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=8, prefix_cache_bytes=0)
    order = admission_order(sampler)
    tasks = [owned("group", "g0", 1, n=3), owned("group", "g1", 2, n=3)]
    tasks += [owned("single", f"s{i}", 10 + i) for i in range(4)]
    sampler.add(owned("group", "first", 0, n=8, max_tokens=2))  # all eight rows, while the rest arrive
    scheduler_steps(sampler, 1)
    run(sampler, tasks)
    # Places: g0 0, g1 3; s0 0, s1 1, s2 2, s3 3 (ties in arrival order).
    assert order[1:] == ["g0", "s0", "s1", "s2", "g1", "s3"], order


def test_preemption_takes_rows_from_the_key_that_holds_the_most(qwen3_dir):
    """Under a K/V budget the growing rows must give some back: the newest request of the key
    holding the most rows is preempted, not the other key's request just because it came last;
    every request still completes."""
    model = fresh_model(qwen3_dir)
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 64 * cfg.head_dim * 4  # one row of 64 positions
    sampler = make_sampler(model, qwen3_dir, kv_cache_bytes=8 * row_bytes, prefix_cache_bytes=0)
    preempted: list = []
    preempt = sampler._preempt
    sampler._preempt = lambda st: (preempted.append(st.task.key), preempt(st))[1]
    for i in range(3):
        sampler.add(owned("busy", f"busy{i}", i, max_tokens=150))
    out = scheduler_steps(sampler, 1)
    sampler.add(owned("light", "light", 9, max_tokens=150))  # admitted last: the newest request
    out.update(run(sampler, []))
    assert len(out) == 4 and not any(isinstance(r, Exception) for r in out.values())
    # Four rows of 123 positions outgrow 8 blocks: the busy key gives back two of its three.
    assert preempted[:2] == ["busy2", "busy1"] and "light" not in preempted, preempted


def test_a_key_below_its_share_gets_rows_back_from_long_generations(qwen3_dir):
    """The busy key fills every row with long generations; the light key's request, after
    waiting FAIR_SHARE_WAIT_STEPS decode steps, takes a row back from the busy key's newest
    request (one row of it, not all), and is done long before the busy rows end. The busy
    key's sequences come out exactly as without the light key (a resumed row decodes on from
    its sampled tokens)."""
    from tinsmith.sampling.sampler import FAIR_SHARE_WAIT_STEPS

    def busy():
        return [owned("busy", "b0", 1, n=2, max_tokens=200), owned("busy", "b1", 2, n=2, max_tokens=200)]

    alone = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=4, prefix_cache_bytes=0)
    ref = run(alone, busy())
    sampler = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=4, prefix_cache_bytes=0)
    for t in busy():
        sampler.add(t)
    out = scheduler_steps(sampler, 1)
    steps_at_arrival = sampler.stats["decode_steps"]
    sampler.add(owned("light", "light", 9, max_tokens=4))
    finished_at: dict = {}
    while sampler.has_work():  # a decode step at a time (admission comes first in each)
        for key, res in scheduler_steps(sampler, 1).items():
            out[key] = res
            finished_at[key] = sampler.stats["decode_steps"]
    assert not any(isinstance(r, Exception) for r in out.values()), out
    assert sampler.stats["yielded_rows"] == 1 and sampler.stats["preempted"] == 1  # one row of b1, the newest
    waited = finished_at["light"] - steps_at_arrival
    assert FAIR_SHARE_WAIT_STEPS <= waited < FAIR_SHARE_WAIT_STEPS + 40, waited  # not the busy rows' 200
    assert finished_at["light"] < min(finished_at["b0"], finished_at["b1"])
    for key in ("b0", "b1"):
        for a, b in zip(ref[key].sequences, out[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert abs(a.logprobs - b.logprobs).max() < 1e-4


def test_no_rows_are_taken_within_fair_shares(qwen3_dir):
    """Two keys holding two rows each of four: a third request of either key waits for a row to
    free up (each holds its share), and nothing is preempted."""
    sampler = make_sampler(fresh_model(qwen3_dir), qwen3_dir, max_rows=4, prefix_cache_bytes=0)
    for t in [owned("a", "a0", 1, n=2, max_tokens=120), owned("b", "b0", 2, n=2, max_tokens=120)]:
        sampler.add(t)
    out = scheduler_steps(sampler, 1)
    sampler.add(owned("a", "a1", 3, max_tokens=4))
    out.update(run(sampler, []))
    assert len(out) == 3 and not any(isinstance(r, Exception) for r in out.values())
    assert sampler.stats["yielded_rows"] == 0 and sampler.stats["preempted"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_keys_under_a_kv_budget_finish_as_each_alone(qwen3_dir, monkeypatch, seed):
    """Three keys' requests (one to three samples, 60 to 250 new tokens) arriving over time into
    six rows under a K/V budget that forces preemptions: rows taken back for fair shares (the
    wait shortened to 4 steps) and for K/V, whole requests and some rows of one, interleave. Every
    request finishes once, and samples what it samples alone (see :func:`assert_same_draws`)."""
    import numpy as np

    from tinsmith.sampling import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "FAIR_SHARE_WAIT_STEPS", 4)
    model = fresh_model(qwen3_dir)
    cfg = model.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * 64 * cfg.head_dim * 4  # one row of 64 positions
    g = np.random.default_rng(seed)
    arrivals = sorted((int(g.integers(0, 12)), i) for i in range(16))
    tasks = {i: owned(f"k{int(g.integers(0, 3))}", f"t{i}", 100 * seed + i, n=int(g.integers(1, 4)),
                      max_tokens=int(g.integers(60, 250)), temperature=1.0) for _, i in arrivals}
    sampler = make_sampler(model, qwen3_dir, max_rows=6, kv_cache_bytes=14 * row_bytes, prefix_cache_bytes=0)
    for_budget: list = []  # requests preempted to stay within the K/V budget
    victim = sampler._preemption_victim
    sampler._preemption_victim = lambda live: for_budget.append(victim(live)) or for_budget[-1]
    out: dict = {}
    step = 0
    while arrivals or sampler.has_work():
        while arrivals and arrivals[0][0] <= step:
            sampler.add(tasks[arrivals.pop(0)[1]])
        for key, res in scheduler_steps(sampler, 1).items():
            assert key not in out, f"{key} finished twice"
            out[key] = res
        step += 1
        assert step < 5000, "the requests never finished"
    assert sorted(out) == sorted(f"t{i}" for i in tasks)
    assert not [r for r in out.values() if isinstance(r, Exception)], [r for r in out.values() if isinstance(r, Exception)]
    # both kinds of preemption ran: rows given back for a fair share, requests for the budget
    assert sampler.stats["yielded_rows"] > 0 and for_budget, sampler.stats
    for i, t in tasks.items():
        alone = run(make_sampler(model, qwen3_dir, max_rows=6, prefix_cache_bytes=0),
                    [owned(t.owner, "alone", 100 * seed + i, n=t.input.num_samples,
                           max_tokens=t.input.params.max_tokens, temperature=1.0)])["alone"]
        for a, b in zip(alone.sequences, out[f"t{i}"].sequences):
            assert_same_draws(a, b, f"t{i}")


def assert_same_draws(alone, got, where: str) -> None:
    """``got`` (a sequence that may have been preempted and resumed) drew what ``alone`` drew.

    Recomputed K/V differ from step-by-step ones by float rounding (~1e-6 in a logprob), which
    tips a draw when it lands that close to the boundary between two tokens: the inverse CDF
    then picks the neighbouring id. So the sequences may part only there: at two adjacent ids,
    after logprobs that agreed to 1e-4 at every earlier position. Anything else (a token lost
    or repeated, a resume over the wrong K/V) shows as logprobs that part first, or other ids."""
    a, b = alone.tokens.tolist(), got.tokens.tolist()
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert abs(alone.logprobs[:k] - got.logprobs[:k]).max(initial=0.0) < 1e-4, where
    if k < min(len(a), len(b)):
        assert abs(a[k] - b[k]) == 1, (where, k, a[k], b[k])
    else:
        assert a == b, where
