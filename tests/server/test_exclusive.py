"""The two guards of one-server-per-store, on their own: the data dir lock and the database lease.

End to end (two real servers, kill -9) in tests/e2e/test_single_server.py; here each way the
lease judges a holder: a process it can check (alive, gone, a reused pid) and one it cannot
(another host or container, or our own pid), the latter with short renewal periods.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from tinsmith.server.exclusive import MISSED_HEARTBEATS, AlreadyServing, DatabaseLease, DataDirLock, pid_namespace
from tinsmith.store import Store

BEAT = 0.2  # renewal period of the leases in these tests


@pytest.fixture
def store(tmp_path):
    s = Store(Store.default_sqlite_url(tmp_path / "db"))
    s.migrate()
    yield s
    s.close()


def test_data_dir_lock_is_exclusive_until_released(tmp_path):
    first = DataDirLock.acquire(tmp_path / "data")
    try:
        with pytest.raises(AlreadyServing) as exc:
            DataDirLock.acquire(tmp_path / "data")
        msg = str(exc.value)
        assert f"data dir {(tmp_path / 'data').resolve()} is in use" in msg
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in msg and "--data-dir" in msg
        other = DataDirLock.acquire(tmp_path / "other")  # another data dir is another lock
        other.release()
    finally:
        first.release()
    DataDirLock.acquire(tmp_path / "data").release()
    assert oct((tmp_path / "data" / "tinsmith.lock").stat().st_mode & 0o777) == oct(0o600)


def _plant(store: Store, *, pid: int, here: bool, age_s: float = 0.0, acquired_ago_s: float = 0.0) -> None:
    """A lease row as another server would have left it: on this machine (``here``) or elsewhere."""
    host, namespace = (socket.gethostname(), pid_namespace()) if here else ("another-host", "another-boot/1")
    assert store.take_lease("planted", host=host, pid=pid, pid_namespace=namespace, data_dir="/elsewhere")
    from sqlalchemy import update

    from tinsmith.store.tables import ServerLeaseTable

    now = datetime.now(UTC)
    with store.engine.begin() as conn:
        conn.execute(update(ServerLeaseTable).values(heartbeat_at=now - timedelta(seconds=age_s),
                                                     acquired_at=now - timedelta(seconds=max(age_s, acquired_ago_s))))


@pytest.fixture
def child():
    """A live process that is not a tinsmith server."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_is_recognised_by_its_renewals(store, tmp_path):
    """Our own pid cannot tell who is alive: the holder's heartbeat does."""
    beat = 0.5  # the holder renews well within the watcher's patience even on a busy machine
    first = DatabaseLease.acquire(store, tmp_path / "a", heartbeat_s=beat)
    try:
        with pytest.raises(AlreadyServing) as exc:
            DatabaseLease.acquire(store, tmp_path / "b", heartbeat_s=beat)
        assert f"pid {os.getpid()}" in str(exc.value) and str((tmp_path / "a").resolve()) in str(exc.value)
        assert "--database-url" in str(exc.value)
        assert store.get_lease().holder == first.holder
    finally:
        first.release()
    assert store.get_lease() is None


def test_a_dead_process_of_this_host_is_taken_over_at_once(store, tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _plant(store, pid=int(gone.stdout), here=True)
    t0 = time.monotonic()
    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=60.0)
    try:
        assert time.monotonic() - t0 < 1.0
        assert store.get_lease().holder == lease.holder and store.get_lease().pid == os.getpid()
    finally:
        lease.release()


@pytest.mark.skipif(pid_namespace() is None, reason="processes can be checked on Linux only")
def test_a_live_process_of_this_host_is_refused_at_once(store, tmp_path, child):
    _plant(store, pid=child.pid, here=True)  # it started before the lease was taken: the holder
    t0 = time.monotonic()
    with pytest.raises(AlreadyServing, match=f"pid {child.pid}, data dir /elsewhere"):
        DatabaseLease.acquire(store, tmp_path, heartbeat_s=60.0)
    assert time.monotonic() - t0 < 1.0  # no waiting for a renewal that will never come
    assert store.get_lease().holder == "planted"


@pytest.mark.skipif(pid_namespace() is None, reason="processes can be checked on Linux only")
def test_a_reused_pid_is_not_taken_for_the_holder(store, tmp_path, child):
    _plant(store, pid=child.pid, here=True, acquired_ago_s=30)  # the process came after the lease
    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=60.0)
    try:
        assert store.get_lease().holder == lease.holder
    finally:
        lease.release()


def test_a_silent_holder_elsewhere_is_taken_over_after_missed_renewals(store, tmp_path, child):
    _plant(store, pid=child.pid, here=False)  # a pid of another machine says nothing here
    t0 = time.monotonic()
    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=BEAT)
    try:
        assert MISSED_HEARTBEATS * BEAT <= time.monotonic() - t0 < 20 * BEAT
        assert store.get_lease().holder == lease.holder
    finally:
        lease.release()


def test_a_long_silent_holder_is_taken_over_without_waiting(store, tmp_path):
    _plant(store, pid=1, here=False, age_s=3600)
    t0 = time.monotonic()
    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=60.0)
    try:
        assert time.monotonic() - t0 < 1.0
    finally:
        lease.release()


def test_a_holder_that_lost_its_lease_is_told(store, tmp_path):
    lost = threading.Event()
    seen = []

    def on_lost(current):
        seen.append(current)
        lost.set()

    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=BEAT, on_lost=on_lost)
    try:
        # as another server does after this one went unrenewed for a while
        assert store.take_lease("usurper", host="h2", pid=7, data_dir="/d2", replacing=lease.holder)
        assert lost.wait(5 * BEAT)
        assert seen[0].holder == "usurper" and seen[0].host == "h2"
    finally:
        lease.release()
    assert store.get_lease().holder == "usurper"  # releasing a lost lease leaves the new holder's


def test_a_lease_deleted_by_hand_is_taken_again(store, tmp_path):
    lease = DatabaseLease.acquire(store, tmp_path, heartbeat_s=BEAT)
    try:
        assert store.release_lease(lease.holder)  # as an operator deleting the row would
        deadline = time.monotonic() + 20 * BEAT
        while store.get_lease() is None and time.monotonic() < deadline:
            time.sleep(BEAT / 4)
        assert store.get_lease().holder == lease.holder
    finally:
        lease.release()
