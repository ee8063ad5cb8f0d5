"""Completion order of sampling requests (retrieve_futures cursors), usage buckets, session traces."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest

from tinsmith.store import Store, UsageRecord
from tinsmith.store.store import CLONE_BLOCK


def _sample(store: Store, sid: str, seq_id: int, owner: str = "alice") -> str:
    rec, _ = store.create_request(owner=owner, kind="sample", payload=b"{}", payload_type="json",
                                  sampling_session_id=sid, seq_id=seq_id)
    return rec.request_id


def test_completions_are_numbered_per_sampler_and_filtered_by_clone(store: Store) -> None:
    store.create_sampling_session("s", owner="alice", base_model="b")
    store.create_sampling_session("t", owner="alice", base_model="b")
    a, b, c = (_sample(store, "s", i) for i in (1, 2, 3))
    clone = _sample(store, "s", 2 * CLONE_BLOCK + 1)
    other = _sample(store, "t", 1)
    assert store.sampling_completions("s", 0, 0) == ([], 0)
    assert store.complete_request(b, b"12345", "application/json")
    assert store.fail_request(a, "boom", "user")
    assert store.complete_request(clone, b"x", "application/json")
    assert store.complete_request(other, b"y", "application/json")
    assert not store.complete_request(b, b"again", "application/json")  # first outcome wins, no new number
    found, cursor = store.sampling_completions("s", 0, 0)
    assert [(f.request_id, f.status, f.result_size, f.completion_seq) for f in found] == [
        (b, "completed", 5, 1), (a, "failed", None, 2)]
    assert cursor == 3  # the clone's completion counts in the shared order
    assert store.sampling_completions("s", 0, cursor) == ([], 3)
    assert [f.request_id for f in store.sampling_completions("s", 2, 0)[0]] == [clone]
    assert store.sampling_completions("t", 0, 0)[0][0].completion_seq == 1
    assert store.get_request(c).completion_seq is None
    assert store.complete_request(c, b"z", "application/json")
    assert [f.request_id for f in store.sampling_completions("s", 0, cursor)[0]] == [c]
    assert store.sampling_completions("missing", 0, 0) == ([], 0)


def test_completion_pages_end_at_the_last_listed(store: Store) -> None:
    store.create_sampling_session("s", owner="o", base_model="b")
    ids = [_sample(store, "s", i, "o") for i in range(5)]
    for rid in ids:
        store.complete_request(rid, b"r", "application/json")
    first, cursor = store.sampling_completions("s", 0, 0, limit=2)
    assert [f.request_id for f in first] == ids[:2] and cursor == 2
    rest, cursor = store.sampling_completions("s", 0, cursor, limit=10)
    assert [f.request_id for f in rest] == ids[2:] and cursor == 5


def test_concurrent_completions_get_distinct_numbers(store: Store) -> None:
    store.create_sampling_session("s", owner="o", base_model="b")
    ids = [_sample(store, "s", i, "o") for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda rid: store.complete_request(rid, b"r", "application/json"), ids))
    found, cursor = store.sampling_completions("s", 0, 0)
    assert sorted(f.completion_seq for f in found) == list(range(1, 41)) and cursor == 40


def test_purge_retrieved_touches_only_the_owners_finished_requests(store: Store) -> None:
    store.create_sampling_session("s", owner="alice", base_model="b")
    done, running, foreign = _sample(store, "s", 1), _sample(store, "s", 2), _sample(store, "s", 3, "mallory")
    store.complete_request(done, b"r", "application/json")
    store.complete_request(foreign, b"r", "application/json")
    assert store.purge_retrieved("alice", "s", [done, running, foreign, "nope"]) == 1
    assert store.get_request(done).is_purged and store.get_request(done).result is None
    assert not store.get_request(running).is_purged and store.get_request(foreign).result == b"r"
    assert store.sampling_completions("s", 0, 0)[0][0].result_size is None


def test_usage_buckets_add_up_in_batches(store: Store) -> None:
    hour = datetime(2026, 1, 1, 10, tzinfo=UTC)
    rows = [UsageRecord("alice", hour, "training", "m", "s1", 100),
            UsageRecord("alice", hour, "sampling_sample", "m", "s1", 7),
            UsageRecord("bob", hour, "training", "m", "", 5)]
    store.add_usage(rows)
    store.add_usage([UsageRecord("alice", hour, "training", "m", "s1", 20),
                     UsageRecord("alice", hour + timedelta(hours=1), "sampling_prefill", "m", "s1", 3)])
    got = store.usage_between("alice", hour, hour + timedelta(hours=2))
    assert [(u.bucket_start, u.kind, u.tokens) for u in got] == [
        (hour, "training", 120), (hour, "sampling_sample", 7), (hour + timedelta(hours=1), "sampling_prefill", 3)]
    assert [u.tokens for u in store.usage_between("alice", hour, hour + timedelta(hours=1))] == [120, 7]
    assert store.usage_between("carol", hour, hour + timedelta(hours=2)) == []


def test_storage_summary_and_session_trace(store: Store) -> None:
    sess = store.create_session("alice", project_id="p1")
    other = store.create_session("alice")
    run, _ = store.create_model("r1", session_id=sess.session_id, owner="alice", base_model="b", lora_rank=4)
    run2, _ = store.create_model("r2", session_id=other.session_id, owner="alice", base_model="b", lora_rank=4)
    store.put_checkpoint(run.model_id, "weights", "a", owner="alice", storage_path="/x", size_bytes=100)
    store.put_checkpoint(run2.model_id, "weights", "b", owner="alice", storage_path="/y", size_bytes=50)
    assert store.owner_storage_summary("alice") == (2, 150)
    assert store.owner_storage_summary("alice", "p1") == (1, 100)
    assert store.owner_storage_summary("bob") == (0, 0)
    fb, _ = store.create_request(owner="alice", kind="forward_backward", payload=b"abc", payload_type="json",
                                 model_id=run.model_id, seq_id=1)
    store.create_sampling_session("samp", owner="alice", base_model="b", session_id=sess.session_id)
    sample = _sample(store, "samp", 1)
    store.complete_request(fb.request_id, b"result", "application/json")
    store.create_request(owner="alice", kind="forward", payload=b"", payload_type="json",
                         model_id=run2.model_id, seq_id=1)
    trace = store.session_trace(sess.session_id)
    assert [(t.request_id, t.status, t.payload_bytes, t.result_bytes) for t in trace] == [
        (fb.request_id, "completed", 3, 6), (sample, "pending", 2, None)]


def test_0006_upgrades_existing_samplers_and_round_trips(db_url: str) -> None:
    """A 0005 database keeps its samplers and requests; their completions start at 1."""
    from alembic import command
    from sqlalchemy import inspect, text

    from tinsmith.store.connect import alembic_config, run_migrations

    store = Store(db_url)
    try:
        run_migrations(store.engine, "0005")
        with store.engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO sampling_sessions (sampling_session_id, owner, base_model, created_at, "
                "next_client_counter, next_sequence_number) VALUES ('old', 'o', 'b', :t, 0, 0)"),
                {"t": datetime(2025, 1, 1, tzinfo=UTC)})
        store.migrate()
        rid = _sample(store, "old", 1, "o")
        assert store.complete_request(rid, b"r", "application/json")
        assert store.sampling_completions("old", 0, 0)[1] == 1
        config = alembic_config()
        with store.engine.begin() as conn:  # downgrade: the columns and table go, the sampler stays
            config.attributes["connection"] = conn
            command.downgrade(config, "0005")
        assert "usage" not in inspect(store.engine).get_table_names()
        assert "completion_seq" not in {c["name"] for c in inspect(store.engine).get_columns("requests")}
        store.migrate()
        assert store.get_sampling_session("old") is not None
        assert store.get_request(rid).completion_seq is None  # numbers are not restored by a downgrade
    finally:
        store.close()


def test_outcomes_stored_together_are_numbered_in_their_order(store: Store) -> None:
    """``finish_requests`` (one sampling slice's outcomes in one transaction): each sampler's
    completions take consecutive numbers in the list's order, failures included; the first
    outcome of a request wins, within the list and against an earlier one; training outcomes
    take no number and add their metric point."""
    from tinsmith.store import MetricPoint, RequestOutcome

    store.create_sampling_session("s", owner="o", base_model="b")
    store.create_sampling_session("t", owner="o", base_model="b")
    a, b, c = (_sample(store, "s", i, "o") for i in (1, 2, 3))
    other = _sample(store, "t", 1, "o")
    store.create_model("m", owner="o", base_model="b")
    train, _ = store.create_request(owner="o", kind="forward_backward", payload=b"{}", payload_type="json",
                                    model_id="m", seq_id=1)
    assert store.complete_request(a, b"first", "application/json")
    point = MetricPoint("m", "o", 1, "forward_backward", {"loss": 0.5})
    done = store.finish_requests([
        RequestOutcome(c, b"ccc", "application/x-protobuf"),
        RequestOutcome(other, error="bad prompt", category="user"),
        RequestOutcome(a, b"late", "application/json"),  # already finished
        RequestOutcome(b, error="cancelled", category="user"),
        RequestOutcome(c, b"again", "application/json"),  # the list's second outcome of c
        RequestOutcome(train.request_id, b"{}", "application/json", metric_point=point),
    ])
    assert done == [True, True, False, True, False, True]
    found, cursor = store.sampling_completions("s", 0, 0)
    assert [(f.request_id, f.status, f.result_size, f.completion_seq) for f in found] == [
        (a, "completed", 5, 1), (c, "completed", 3, 2), (b, "failed", None, 3)]
    assert cursor == 3
    rec = store.get_request(c)
    assert rec.result == b"ccc" and rec.result_content_type == "application/x-protobuf" and rec.error is None
    failed = store.get_request(other)
    assert (failed.status, failed.error, failed.error_category, failed.completion_seq) == (
        "failed", "bad prompt", "user", 1)
    assert store.get_request(a).result == b"first"
    t = store.get_request(train.request_id)
    assert t.status == "completed" and t.completion_seq is None and t.completed_at is not None
    assert [(p.step, p.metrics) for p in store.list_run_metrics("m")] == [(1, {"loss": 0.5})]
    assert store.finish_requests([RequestOutcome(b, b"x", "application/json")]) == [False]
    assert store.finish_requests([]) == []


def test_an_outcome_records_when_its_work_began(store: Store) -> None:
    """The engine passes when a request left its queue: stored beside its arrival and end (a
    request's whole timeline from one record); an outcome without it keeps what was stored."""
    from tinsmith.store import RequestOutcome

    store.create_sampling_session("s", owner="o", base_model="b")
    a, b, c = (_sample(store, "s", i, "o") for i in (1, 2, 3))
    arrived = store.get_request(a).created_at
    began = arrived + timedelta(milliseconds=250)
    assert store.mark_running(c)
    marked = store.get_request(c).started_at
    assert store.finish_requests([
        RequestOutcome(a, b"x", "application/json", started_at=began),
        RequestOutcome(b, error="bad prompt", category="user", started_at=began + timedelta(seconds=1)),
        RequestOutcome(c, b"y", "application/json"),
    ]) == [True, True, True]
    assert store.get_request(a).started_at == began
    assert store.get_request(b).started_at == began + timedelta(seconds=1)
    assert marked is not None and store.get_request(c).started_at == marked
    with pytest.raises(ValueError, match="naive"):
        store.finish_requests([RequestOutcome(_sample(store, "s", 4, "o"), b"z", "application/json",
                                              started_at=began.replace(tzinfo=None))])


def test_a_sample_request_reserves_its_numbers_in_the_same_transaction(store: Store) -> None:
    """``create_sample_request``: the sampler's numbers and the request are one commit; a
    replay of the same seq_id reserves nothing and answers with the first request; an unknown
    sampler gives None."""
    store.create_sampling_session("s", owner="o", base_model="b")

    def create(seq_id: int, n: int):
        return store.create_sample_request(owner="o", sampling_session_id="s", num_samples=n, payload=b"{}",
                                           payload_type="json", seq_id=seq_id,
                                           submit_info_for=lambda first: {"ids": list(range(first, first + n))})

    rec, created = create(1, 3)
    assert created and rec.submit_info == {"ids": [0, 1, 2]} and rec.status == "pending" and rec.kind == "sample"
    again, created = create(1, 3)
    assert not created and again.request_id == rec.request_id and again.submit_info == {"ids": [0, 1, 2]}
    nxt, _ = create(2, 2)
    assert nxt.submit_info == {"ids": [3, 4]}
    assert create(3, 1)[0].submit_info == {"ids": [5]}  # the replay took no numbers
    assert store.create_sample_request(owner="o", sampling_session_id="nope", num_samples=1, payload=b"{}",
                                       payload_type="json", submit_info_for=lambda first: {}) is None


def test_sampler_records_are_kept_once_read(store: Store, db_url: str) -> None:
    """A sampler's record never changes, so the store keeps those it read or wrote; another
    store on the same database reads it from there first."""
    assert store.cached_sampling_session("s") is None
    made, _ = store.create_sampling_session("s", owner="o", base_model="b", model_path="tinker://r/sampler_weights/x")
    assert store.cached_sampling_session("s") == made
    other = Store(db_url)
    try:
        assert other.cached_sampling_session("s") is None
        assert other.get_sampling_session("s") == made
        assert other.cached_sampling_session("s") == made
        assert other.get_sampling_session("missing") is None and other.cached_sampling_session("missing") is None
    finally:
        other.close()
