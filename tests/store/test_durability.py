from __future__ import annotations

from pathlib import Path

from tinsmith.store import Store, model_id_for


def test_data_survives_close_and_reopen(db_url: str, clock) -> None:
    store = Store(db_url, clock=clock)
    store.migrate()
    session = store.create_session("alice", tags=["t"])
    mid = model_id_for(session.session_id, 0)
    model, _ = store.create_model(mid, owner="alice", base_model="b", session_id=session.session_id)
    done, _ = store.create_request(
        owner="alice",
        kind="optim_step",
        payload=b'{"seq_id": 1}',
        payload_type="json",
        model_id=mid,
        seq_id=1,
    )
    store.complete_request(done.request_id, b'{"metrics": {}}', "application/json")
    pending, _ = store.create_request(
        owner="alice",
        kind="forward_backward",
        payload=b"\x00\x01",
        payload_type="protobuf",
        model_id=mid,
        seq_id=2,
    )
    ck = store.put_checkpoint(mid, "weights", "w", owner="alice", storage_path="/p")
    store.close()

    reopened = Store(db_url, clock=clock)
    try:
        reopened.migrate()  # a restart migrates again: must keep everything
        assert reopened.get_session(session.session_id) == session
        assert reopened.get_model(mid) == model
        assert reopened.get_request(done.request_id).result == b'{"metrics": {}}'
        assert [r.request_id for r in reopened.list_unfinished_requests()] == [pending.request_id]
        assert reopened.get_checkpoint(mid, "weights", "w") == ck
        # Dedup still holds across the restart.
        again, created = reopened.create_request(
            owner="alice",
            kind="forward_backward",
            payload=b"",
            payload_type="protobuf",
            model_id=mid,
            seq_id=2,
        )
        assert not created and again.request_id == pending.request_id
    finally:
        reopened.close()


def test_sqlite_file_lives_under_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "nested" / "data"
    url = Store.default_sqlite_url(data_dir)
    assert url == f"sqlite:///{data_dir.resolve()}/tinsmith.sqlite"
    with Store(url) as store:
        store.migrate()
        store.create_session("o")
    assert (data_dir / "tinsmith.sqlite").is_file()
    with Store(url) as store:
        assert store.list_sessions("o").total == 1
