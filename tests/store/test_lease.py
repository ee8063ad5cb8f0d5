"""The server lease row: at most one holder, atomic hand-over, renew and release by the holder only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tinsmith.store import Store


def _take(store: Store, holder: str, replacing: str | None = None, pid: int = 1) -> bool:
    return store.take_lease(holder, host="h", pid=pid, data_dir="/d", replacing=replacing)


def test_take_renew_release(store: Store, clock) -> None:
    assert store.get_lease() is None
    assert _take(store, "a", pid=11)
    lease = store.get_lease()
    assert (lease.holder, lease.host, lease.pid, lease.data_dir) == ("a", "h", 11, "/d")
    assert lease.acquired_at == lease.heartbeat_at
    assert not _take(store, "b")  # held: a free-lease take fails
    assert store.get_lease().holder == "a"

    clock.advance(3)
    assert store.renew_lease("a")
    assert store.get_lease().heartbeat_at > lease.heartbeat_at
    assert not store.renew_lease("b")  # only the holder renews
    assert not store.release_lease("b")  # ... and releases
    assert store.release_lease("a")
    assert store.get_lease() is None
    assert not store.renew_lease("a")  # released: a late renewal says so
    assert _take(store, "b")


def test_take_over_only_from_the_holder_seen(store: Store) -> None:
    assert _take(store, "a")
    assert not _take(store, "c", replacing="someone-else")
    assert _take(store, "b", replacing="a")
    assert store.get_lease().holder == "b"
    assert not store.renew_lease("a")  # the old holder learns it lost the lease
    assert not _take(store, "c", replacing="a")  # a stale judgement changes nothing


def test_racing_take_overs_have_one_winner(store: Store) -> None:
    assert _take(store, "dead")
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: _take(store, f"n{i}", replacing="dead"), range(8)))
    assert won.count(True) == 1
    assert store.get_lease().holder == f"n{won.index(True)}"


def test_racing_first_takes_have_one_winner(store: Store) -> None:
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: _take(store, f"n{i}"), range(8)))
    assert won.count(True) == 1
