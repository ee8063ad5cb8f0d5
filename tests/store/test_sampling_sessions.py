from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tinsmith.store import Store, sampling_session_id_for


def test_create_get_idempotent(store: Store) -> None:
    sid = sampling_session_id_for("sess", 0)
    assert sid == "sess:sample:0"
    rec, created = store.create_sampling_session(
        sid,
        owner="alice",
        base_model="Qwen/Qwen3-0.6B",
        session_id="sess",
        model_path="tinker://sess:train:0/sampler_weights/s1",
    )
    assert created and store.get_sampling_session(sid) == rec
    again, created_again = store.create_sampling_session(sid, owner="alice", base_model="x")
    assert not created_again and again == rec
    store.create_sampling_session("sess:sample:1", owner="alice", base_model="b", session_id="sess")
    store.create_sampling_session("elsewhere", owner="alice", base_model="b", session_id="other")
    listed = store.list_session_sampling_sessions("sess")
    assert [r.sampling_session_id for r in listed] == [sid, "sess:sample:1"]
    assert store.get_sampling_session("missing") is None


def test_join_counter_and_sequence_numbers(store: Store) -> None:
    store.create_sampling_session("s", owner="o", base_model="b")
    assert [store.join_sampling_session("s") for _ in range(3)] == [1, 2, 3]
    assert store.reserve_sequence_numbers("s", 4) == 0
    assert store.reserve_sequence_numbers("s", 1) == 4
    assert store.reserve_sequence_numbers("s", 2) == 5
    assert store.join_sampling_session("missing") is None
    assert store.reserve_sequence_numbers("missing", 1) is None
    with pytest.raises(ValueError):
        store.reserve_sequence_numbers("s", 0)


def test_counters_are_unique_under_concurrency(store: Store) -> None:
    store.create_sampling_session("s", owner="o", base_model="b")
    threads, per_thread = 8, 10
    barrier = threading.Barrier(threads)

    def work(_: int) -> list[int]:
        barrier.wait()
        return [store.join_sampling_session("s") for _ in range(per_thread)]

    with ThreadPoolExecutor(threads) as pool:
        got = [c for batch in pool.map(work, range(threads)) for c in batch]
    assert sorted(got) == list(range(1, threads * per_thread + 1))
