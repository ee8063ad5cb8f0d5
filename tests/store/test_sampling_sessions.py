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

    def first_number(sid: str, n: int) -> int | None:
        made = store.create_sample_request(owner="o", sampling_session_id=sid, num_samples=n, payload=b"{}",
                                           payload_type="json", submit_info_for=lambda first: {"first": first})
        return None if made is None else made[0].submit_info["first"]

    assert [first_number("s", 4), first_number("s", 1), first_number("s", 2)] == [0, 4, 5]
    assert store.join_sampling_session("missing") is None
    assert first_number("missing", 1) is None
    with pytest.raises(ValueError):
        first_number("s", 0)


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
