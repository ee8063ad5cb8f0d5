from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tinsmith.store import Store

BLOB = bytes(range(256)) * 64  # binary with NULs: protobuf bodies must round-trip exactly


def _req(store: Store, **kw):
    kw.setdefault("owner", "alice")
    kw.setdefault("kind", "forward_backward")
    kw.setdefault("payload", BLOB)
    kw.setdefault("payload_type", "protobuf")
    return store.create_request(**kw)


def test_create_and_get(store: Store) -> None:
    rec, created = _req(store, model_id="m", seq_id=1, submit_info={"x": [1, 2]})
    assert created and rec.request_id.startswith("req-")
    got = store.get_request(rec.request_id)
    assert got == rec
    assert got.payload == BLOB and got.payload_type == "protobuf"
    assert got.status == "pending" and got.result is None and not got.is_finished
    assert got.submit_info == {"x": [1, 2]}
    assert store.get_request("req-missing") is None


def test_dedup_on_model_seq_id(store: Store) -> None:
    first, created = _req(store, model_id="m", seq_id=1)
    again, created_again = _req(store, model_id="m", seq_id=1, payload=b"different")
    assert created and not created_again
    assert again == first and again.payload == BLOB
    # Other sequence numbers or other models are different requests.
    assert _req(store, model_id="m", seq_id=2)[1]
    assert _req(store, model_id="m2", seq_id=1)[1]
    # The same number under a sampling session is a different key.
    assert _req(store, sampling_session_id="m", seq_id=1)[1]


def test_dedup_on_sampling_session_seq_id(store: Store) -> None:
    first, _ = _req(
        store,
        kind="sample",
        sampling_session_id="s:sample:0",
        seq_id=5,
        submit_info={"sample_sequence_ids": ["a", "b"]},
    )
    again, created = _req(store, kind="sample", sampling_session_id="s:sample:0", seq_id=5)
    assert not created and again.request_id == first.request_id
    assert again.submit_info == {"sample_sequence_ids": ["a", "b"]}


def test_dedup_on_explicit_request_id(store: Store) -> None:
    first, _ = _req(store, request_id="req-fixed")
    again, created = _req(store, request_id="req-fixed")
    assert not created and again == first


def test_both_ordering_keys_rejected(store: Store) -> None:
    with pytest.raises(ValueError):
        _req(store, model_id="m", sampling_session_id="s", seq_id=1)


def test_large_seq_ids_of_cloned_samplers(store: Store) -> None:
    seq = 1_000_000_000 * 999_999_999 + 7  # clone blocks of 10^9 need 64-bit ids
    rec, _ = _req(store, sampling_session_id="s", seq_id=seq)
    assert store.get_request(rec.request_id).seq_id == seq


@pytest.mark.parametrize("key", ["model_id", "sampling_session_id"])
def test_concurrent_duplicates_yield_one_request(store: Store, key: str) -> None:
    threads, seqs = 8, 5
    barrier = threading.Barrier(threads)

    def submit(_: int):
        barrier.wait()
        return [_req(store, **{key: "k"}, seq_id=seq) for seq in range(seqs)]

    with ThreadPoolExecutor(threads) as pool:
        results = [r for batch in pool.map(submit, range(threads)) for r in batch]
    for seq in range(seqs):
        mine = [(rec, created) for rec, created in results if rec.seq_id == seq]
        assert len(mine) == threads
        assert sum(created for _, created in mine) == 1
        assert len({rec.request_id for rec, _ in mine}) == 1
    assert len(store.list_unfinished_requests()) == seqs


def test_complete_first_outcome_wins(store: Store) -> None:
    rec, _ = _req(store, model_id="m", seq_id=1)
    assert store.mark_running(rec.request_id)
    assert not store.mark_running(rec.request_id)
    running = store.get_request(rec.request_id)
    assert running.status == "running" and running.started_at is not None

    assert store.complete_request(rec.request_id, b"\x00result", "application/x-protobuf")
    assert not store.complete_request(rec.request_id, b"other", "application/json")
    assert not store.fail_request(rec.request_id, "late", "server")
    assert not store.mark_running(rec.request_id)
    done = store.get_request(rec.request_id)
    assert done.status == "completed" and done.is_finished
    assert done.result == b"\x00result"
    assert done.result_content_type == "application/x-protobuf"
    assert done.error is None and done.completed_at >= done.started_at


def test_fail_request(store: Store) -> None:
    rec, _ = _req(store, model_id="m", seq_id=1)
    assert store.fail_request(rec.request_id, "bad loss_fn", "user")  # straight from pending
    assert not store.complete_request(rec.request_id, b"{}", "application/json")
    failed = store.get_request(rec.request_id)
    assert (failed.status, failed.error, failed.error_category) == ("failed", "bad loss_fn", "user")
    assert failed.result is None and failed.completed_at is not None
    with pytest.raises(ValueError):
        store.fail_request(rec.request_id, "x", "User")
    assert not store.fail_request("req-missing", "x")


def test_unfinished_requests_for_recovery(store: Store) -> None:
    a, _ = _req(store, model_id="m", seq_id=1)
    b, _ = _req(store, model_id="m", seq_id=2)
    c, _ = _req(store, kind="sample", sampling_session_id="s", seq_id=1, payload_type="json")
    d, _ = _req(store, model_id="m", seq_id=3)
    store.mark_running(a.request_id)
    store.complete_request(b.request_id, b"{}", "application/json")
    store.fail_request(d.request_id, "boom")
    unfinished = store.list_unfinished_requests()
    assert [r.request_id for r in unfinished] == [a.request_id, c.request_id]
    assert [r.status for r in unfinished] == ["running", "pending"]
    assert unfinished[0].payload == BLOB  # enough to re-run it

    assert store.requeue_request(a.request_id)
    assert not store.requeue_request(a.request_id)
    again = store.get_request(a.request_id)
    assert again.status == "pending" and again.started_at is None


def test_pending_requests_per_model_in_seq_order(store: Store) -> None:
    # Chunks of one forward_backward arrive out of order (first chunk last).
    for seq in (3, 2, 4, 1):
        _req(store, model_id="m", seq_id=seq)
    _req(store, model_id="other", seq_id=0)
    running = store.list_pending_requests("m")[0]
    store.mark_running(running.request_id)
    assert running.seq_id == 1
    assert [r.seq_id for r in store.list_pending_requests("m")] == [2, 3, 4]
    assert [r.seq_id for r in store.list_pending_requests("other")] == [0]
    assert store.list_pending_requests("none") == []


def test_purge_drops_payloads_and_results_but_keeps_the_record(store: Store, clock) -> None:
    old, _ = _req(store, model_id="m", seq_id=1)
    store.complete_request(old.request_id, BLOB, "application/x-protobuf")
    failed, _ = _req(store, model_id="m", seq_id=2)
    store.fail_request(failed.request_id, "bad input", "user")
    pending, _ = _req(store, model_id="m", seq_id=3)
    clock.advance(60)
    cutoff = clock.now
    new, _ = _req(store, model_id="m", seq_id=4)
    store.complete_request(new.request_id, b"{}", "application/json")

    assert store.purge_request_payloads(cutoff) == 2
    done = store.get_request(old.request_id)
    assert done.is_purged and done.payload == b"" and done.result is None
    assert (done.request_id, done.kind, done.owner, done.status) == (old.request_id, "forward_backward", "alice", "completed")
    assert done.created_at == old.created_at and done.completed_at is not None and done.purged_at > cutoff
    gone_failed = store.get_request(failed.request_id)
    assert gone_failed.is_purged and gone_failed.payload == b""
    assert (gone_failed.status, gone_failed.error, gone_failed.error_category) == ("failed", "bad input", "user")
    # unfinished and recent requests keep everything
    for r, result in ((pending, None), (new, b"{}")):
        kept = store.get_request(r.request_id)
        assert not kept.is_purged and kept.payload == BLOB and kept.result == result
    # a replay of a purged request's seq_id still finds the same request
    again, created = _req(store, model_id="m", seq_id=1)
    assert not created and again.request_id == old.request_id
    # once purged, a request is not purged again (its purge time stays)
    clock.advance(60)
    assert store.purge_request_payloads(clock.now) == 1  # only `new`
    assert store.get_request(old.request_id).purged_at == done.purged_at


def test_a_result_is_read_as_the_full_record_has_it_without_the_payload(store: Store, clock) -> None:
    """``get_result`` (what answering a future reads) agrees with ``get_request`` field for field,
    pending, completed (binary result), failed and purged alike, and knows no missing request."""
    pending, _ = _req(store, model_id="m", seq_id=1)
    done, _ = _req(store, model_id="m", seq_id=2)
    store.complete_request(done.request_id, b"\x00result", "application/x-protobuf")
    failed, _ = _req(store, owner="bob", model_id="m", seq_id=3)
    store.fail_request(failed.request_id, "bad loss_fn", "user")
    purged, _ = _req(store, model_id="m", seq_id=4)
    store.complete_request(purged.request_id, BLOB, "application/x-protobuf")
    clock.advance(60)
    assert store.purge_request_payloads(clock.now) == 3
    clock.advance(1)
    done2, _ = _req(store, model_id="m", seq_id=5)
    store.complete_request(done2.request_id, BLOB, "application/json")
    for r in (pending, done, failed, purged, done2):
        full, got = store.get_request(r.request_id), store.get_result(r.request_id)
        assert not hasattr(got, "payload")
        assert (got.request_id, got.owner, got.status, got.result, got.result_content_type, got.error,
                got.error_category, got.purged_at, got.is_purged) == (
            full.request_id, full.owner, full.status, full.result, full.result_content_type, full.error,
            full.error_category, full.purged_at, full.is_purged)
    assert store.get_result(done2.request_id).result == BLOB and store.get_result(failed.request_id).owner == "bob"
    assert store.get_result(purged.request_id).is_purged and store.get_result(purged.request_id).purged_at.tzinfo
    assert store.get_result("req-missing") is None


def test_purge_works_through_a_backlog_in_batches(store: Store, clock) -> None:
    ids = []
    for seq in range(7):
        r, _ = _req(store, model_id="m", seq_id=seq)
        store.complete_request(r.request_id, b"x", "application/json")
        ids.append(r.request_id)
    clock.advance(1)
    assert store.purge_request_payloads(clock.now, batch=3) == 7
    assert all(store.get_request(i).is_purged for i in ids)
