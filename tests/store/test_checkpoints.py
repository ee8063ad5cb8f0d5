from __future__ import annotations

from datetime import timedelta

import pytest

from tinsmith.errors import ConflictError
from tinsmith.store import Store


def _put(store: Store, run: str, kind: str, name: str, owner: str = "alice", **kw):
    kw.setdefault("storage_path", f"/data/{run}/{kind}/{name}")
    return store.put_checkpoint(run, kind, name, owner=owner, **kw)


def test_put_get(store: Store) -> None:
    ck = _put(
        store, "s:train:0", "weights", "step-1", size_bytes=5 * 2**30, user_metadata={"step": "1"}
    )
    got = store.get_checkpoint("s:train:0", "weights", "step-1")
    assert got == ck
    assert got.size_bytes == 5 * 2**30  # > 32 bits
    assert got.tinker_path == "tinker://s:train:0/weights/step-1"
    assert got.checkpoint_id == "weights/step-1"
    assert (got.public, got.status, got.expires_at) == (False, "ready", None)
    assert store.get_checkpoint("s:train:0", "sampler_weights", "step-1") is None


def test_name_conflict_and_overwrite(store: Store, clock) -> None:
    first = _put(store, "r", "weights", "a", size_bytes=1, user_metadata={"v": "1"})
    with pytest.raises(ConflictError):
        _put(store, "r", "weights", "a", size_bytes=2)
    assert store.get_checkpoint("r", "weights", "a") == first
    # Same name under another kind or run is a different checkpoint.
    _put(store, "r", "sampler_weights", "a")
    _put(store, "r2", "weights", "a")

    store.set_public("r", "weights", "a", True)
    clock.advance(10)
    replaced = _put(store, "r", "weights", "a", size_bytes=3, storage_path="/new", overwrite=True)
    got = store.get_checkpoint("r", "weights", "a")
    assert got == replaced
    assert (got.size_bytes, got.storage_path) == (3, "/new")
    assert (got.user_metadata, got.public) == ({}, False)
    assert got.created_at > first.created_at
    # Overwrite of a new name simply inserts.
    inserted = _put(store, "r", "weights", "b", overwrite=True)
    assert inserted == store.get_checkpoint("r", "weights", "b")


def test_invalid_checkpoints_rejected(store: Store) -> None:
    with pytest.raises(ValueError):
        _put(store, "r", "bogus", "a")
    with pytest.raises(ValueError):
        _put(store, "r", "weights", "a/b")
    with pytest.raises(ValueError):
        _put(store, "r", "weights", "a", status="done")


def test_list_run_checkpoints_newest_first(store: Store) -> None:
    names = [
        ("weights", "w1"),
        ("sampler_weights", "s1"),
        ("external_weights", "e1"),
        ("weights", "w2"),
    ]
    for kind, name in names:
        _put(store, "r", kind, name)
    _put(store, "r", "weights", "saving", status="pending")
    _put(store, "other", "weights", "x")
    listed = store.list_checkpoints("r")
    assert [(c.kind, c.name) for c in listed] == names[::-1]
    assert len(store.list_checkpoints("r", include_unready=True)) == 5
    assert store.latest_checkpoint("r", "weights").name == "w2"
    assert store.latest_checkpoint("r", "sampler_weights").name == "s1"
    assert store.latest_checkpoint("none", "weights") is None


def test_pending_to_ready(store: Store) -> None:
    _put(store, "r", "weights", "a", status="pending")
    assert store.list_user_checkpoints("alice").total == 0
    assert store.set_checkpoint_status("r", "weights", "a", "ready", size_bytes=42)
    got = store.get_checkpoint("r", "weights", "a")
    assert (got.status, got.size_bytes) == ("ready", 42)
    assert store.list_user_checkpoints("alice").total == 1
    assert not store.set_checkpoint_status("r", "weights", "missing", "failed")


def test_user_checkpoints_pagination(store: Store) -> None:
    made = [_put(store, f"run{i % 3}", "weights", f"c{i}") for i in range(7)]
    _put(store, "run0", "weights", "bobs", owner="bob")
    newest_first = [c.tinker_path for c in made[::-1]]
    seen = []
    for offset in (0, 3, 6):
        page = store.list_user_checkpoints("alice", limit=3, offset=offset)
        assert page.total == 7 and page.offset == offset and page.limit == 3
        seen += [c.tinker_path for c in page.items]
    assert seen == newest_first
    assert store.list_user_checkpoints("alice", limit=3, offset=9).items == []
    assert store.list_user_checkpoints("bob").total == 1
    with pytest.raises(ValueError):
        store.list_user_checkpoints("alice", limit=-1)


def test_delete(store: Store) -> None:
    _put(store, "r", "weights", "a")
    assert store.delete_checkpoint("r", "weights", "a")
    assert not store.delete_checkpoint("r", "weights", "a")
    assert store.get_checkpoint("r", "weights", "a") is None
    assert store.list_checkpoints("r") == []


def test_publish_unpublish(store: Store) -> None:
    _put(store, "r", "sampler_weights", "a")
    assert store.set_public("r", "sampler_weights", "a", True)
    assert not store.set_public("r", "sampler_weights", "a", True)  # already public -> 409
    assert store.get_checkpoint("r", "sampler_weights", "a").public
    assert store.set_public("r", "sampler_weights", "a", False)
    assert not store.set_public("r", "sampler_weights", "a", False)
    assert not store.set_public("r", "sampler_weights", "missing", True)


def test_ttl_and_expiry(store: Store, clock) -> None:
    _put(store, "r", "weights", "short")
    _put(store, "r", "weights", "long")
    _put(store, "r", "weights", "forever")
    _put(store, "r", "weights", "preset", expires_at=clock.now + timedelta(seconds=30))
    start = clock.now
    assert store.set_ttl("r", "weights", "short", 3600)
    assert store.set_ttl("r", "weights", "long", 7200)
    assert store.set_ttl("r", "weights", "forever", 3600)
    assert store.set_ttl("r", "weights", "forever", None)  # null removes expiry
    assert not store.set_ttl("r", "weights", "missing", 3600)
    expires = store.get_checkpoint("r", "weights", "short").expires_at
    assert timedelta(seconds=3600) <= expires - start < timedelta(seconds=3601)
    assert store.get_checkpoint("r", "weights", "forever").expires_at is None

    assert [c.name for c in store.list_expired(start)] == []
    assert [c.name for c in store.list_expired(start + timedelta(seconds=60))] == ["preset"]
    assert [c.name for c in store.list_expired(start + timedelta(hours=1, seconds=1))] == [
        "preset",
        "short",
    ]
    clock.advance(3 * 3600)
    assert [c.name for c in store.list_expired()] == ["preset", "short", "long"]
    assert store.set_expires_at("r", "weights", "long", None)
    assert [c.name for c in store.list_expired()] == ["preset", "short"]


def test_storage_bytes_by_owner(store: Store) -> None:
    assert store.storage_bytes_by_owner() == {}
    _put(store, "r1", "weights", "a", owner="alice", size_bytes=5 * 2**30)
    _put(store, "r1", "sampler_weights", "a", owner="alice", size_bytes=7)
    _put(store, "r2", "weights", "a", owner="bob", size_bytes=3)
    assert store.storage_bytes_by_owner() == {"alice": 5 * 2**30 + 7, "bob": 3}
    assert store.storage_bytes_by_owner()["alice"] == store.owner_storage_bytes("alice")
