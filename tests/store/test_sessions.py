from __future__ import annotations

from datetime import timedelta

from tinsmith.store import Store


def test_session_lifecycle(store: Store, clock) -> None:
    s = store.create_session(
        "alice",
        tags=["a", "b"],
        user_metadata={"k": "v", "n": 1},
        sdk_version="0.38.0",
        project_id="p1",
        display_name="run one",
    )
    got = store.get_session(s.session_id)
    assert got == s
    assert got.tags == ["a", "b"] and got.user_metadata == {"k": "v", "n": 1}
    assert not got.is_finished and got.created_at == got.last_heartbeat_at

    assert store.heartbeat(s.session_id)
    beat = store.get_session(s.session_id).last_heartbeat_at
    assert beat > s.last_heartbeat_at

    assert store.finish_session(s.session_id, "success", None)
    # First reason wins; later finishes and heartbeats are refused.
    assert not store.finish_session(s.session_id, "errored", "late")
    assert not store.heartbeat(s.session_id)
    done = store.get_session(s.session_id)
    assert done.is_finished
    assert (done.finish_reason, done.finish_detail) == ("success", None)
    assert done.last_heartbeat_at == beat


def test_unknown_session(store: Store) -> None:
    assert store.get_session("nope") is None
    assert not store.heartbeat("nope")
    assert not store.finish_session("nope", "success")
    assert not store.set_session_project("nope", "p")


def test_session_ids_are_unique_uuid4(store: Store) -> None:
    ids = {store.create_session("o").session_id for _ in range(5)}
    assert len(ids) == 5
    assert all(len(i) == 36 and i[14] == "4" for i in ids)


def test_list_sessions_newest_first_per_owner(store: Store) -> None:
    mine = [store.create_session("alice").session_id for _ in range(5)]
    store.create_session("bob")
    page = store.list_sessions("alice", limit=2, offset=0)
    assert page.total == 5
    assert [s.session_id for s in page.items] == mine[::-1][:2]
    rest = store.list_sessions("alice", limit=10, offset=2)
    assert [s.session_id for s in rest.items] == mine[::-1][2:]
    assert store.list_sessions("carol").total == 0
    assert store.list_sessions("bob").total == 1


def test_set_session_project(store: Store) -> None:
    s = store.create_session("o")
    assert store.set_session_project(s.session_id, "proj")
    assert store.get_session(s.session_id).project_id == "proj"


def test_stale_sessions(store: Store, clock) -> None:
    old = store.create_session("o")
    finished = store.create_session("o")
    store.finish_session(finished.session_id, "interrupted")
    clock.advance(600)
    cutoff = clock.now
    fresh = store.create_session("o")
    stale = store.list_stale_sessions(cutoff)
    assert [s.session_id for s in stale] == [old.session_id]
    assert store.heartbeat(old.session_id)
    assert store.list_stale_sessions(cutoff) == []
    # Everything unfinished is stale against a cutoff in the future.
    later = {s.session_id for s in store.list_stale_sessions(clock.now + timedelta(seconds=1))}
    assert later == {old.session_id, fresh.session_id}


def test_earliest_live_heartbeat(store: Store, clock) -> None:
    """What the sweeper sleeps until: the unfinished session that times out next."""
    assert store.earliest_live_heartbeat() is None
    a = store.create_session("alice")
    clock.advance(5)
    b = store.create_session("bob")
    assert store.earliest_live_heartbeat() == a.created_at
    clock.advance(5)
    store.heartbeat(a.session_id)  # a's deadline moves past b's
    assert store.earliest_live_heartbeat() == b.created_at
    store.finish_session(b.session_id, "success")
    assert store.earliest_live_heartbeat() == store.get_session(a.session_id).last_heartbeat_at
    store.finish_session(a.session_id, "success")
    assert store.earliest_live_heartbeat() is None


def test_count_live_sessions(store: Store) -> None:
    assert store.count_live_sessions() == 0
    a, b = store.create_session("o"), store.create_session("p")
    assert store.count_live_sessions() == 2
    store.finish_session(a.session_id, "success")
    assert store.count_live_sessions() == 1
    store.finish_session(b.session_id, "interrupted", "no heartbeat")
    assert store.count_live_sessions() == 0
