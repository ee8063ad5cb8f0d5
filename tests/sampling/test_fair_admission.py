"""Requests of several API keys waiting for rows: admitted in turns, not in arrival order.

A key with hundreds of requests queued must not make another key's single request wait behind
all of them: each waiting request is placed at the row its key would reach with it (rows held
plus rows queued ahead of it), and the lowest place is admitted first.
"""

from __future__ import annotations

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
