"""One server per data directory and per database.

Two servers on one store would each take the other's live runs for leftovers of a crash
(start-up recovery marks them lost) and execute the same futures twice. Two guards, both taken
before recovery and before any model is loaded, refuse the second server with one line:

* an exclusive ``flock`` on ``DATA_DIR/tinsmith.lock``, held for the life of the process. The
  OS drops it when the process dies, however it dies, so it never needs cleaning up.
* a lease row in the database, for servers with different data directories sharing one
  PostgreSQL database. A thread renews it every few seconds; a clean shutdown deletes it.

A lease left behind by a killed server is taken over. Where the holder's pid can be checked
(same kernel boot and pid namespace) the answer is immediate: no such process, or one started
after the lease was taken (a reused pid), means gone; the process itself means alive. Elsewhere
(another host or container) the holder's heartbeat decides: a renewal means alive, none for a
few periods means gone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from tinsmith.store import LeaseRecord, Store

log = logging.getLogger(__name__)

LOCK_FILE = "tinsmith.lock"
HEARTBEAT_S = 5.0  # lease renewal period
MISSED_HEARTBEATS = 3  # an unverifiable holder that misses this many renewals is gone
STALE_AFTER_S = 120.0  # a heartbeat this old (by this host's clock) is gone without watching
POLL_S = 0.5  # how often a starting server looks at a lease it is watching
START_SLACK_S = 2.0  # a holder's process started at most this long after its lease: a reused pid


class AlreadyServing(RuntimeError):
    """Another live server holds the data dir or the database; the message says who and what to do."""


def _describe(host: str, pid: int) -> str:
    return f"host {host}, pid {pid}"


# ------------------------------------------------------------------------------------ data dir
class DataDirLock:
    """The exclusive lock on a data directory, held until :meth:`release` or process exit.

    The lock file records the holder's host and pid, for the message another server gives.
    It is never deleted: removing a lock file while another process waits on it would let
    two processes hold "the" lock at once.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: str | Path) -> DataDirLock:
        directory = Path(data_dir).resolve()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise AlreadyServing(
                f"data dir {directory} is in use by another tinsmith server ({holder}); "
                "stop it first, or give this server its own --data-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": datetime.now(UTC).isoformat()}).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock (closing the descriptor drops the lock); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return _describe(info["host"], int(info["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"  # it holds the lock but has not written its name yet


# ------------------------------------------------------------------------------------ database
@dataclass(frozen=True)
class _Seen:
    holder: str
    heartbeat_at: datetime
    since: float  # monotonic time of the first sighting


class DatabaseLease:
    """This process's lease on the database, renewed by a daemon thread until :meth:`release`.

    ``on_lost`` runs (once, on the renewal thread) if another server took the lease over, which
    happens only when this one failed to renew it for several periods, e.g. the database was
    unreachable from here. The server then stops rather than serve a store someone else owns.
    """

    def __init__(self, store: Store, holder: str, who: dict, heartbeat_s: float,
                 on_lost: Callable[[LeaseRecord | None], None]) -> None:
        self.store = store
        self.holder = holder
        self._who = who
        self.heartbeat_s = heartbeat_s
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until_stopped, name="tinsmith-lease", daemon=True)

    @classmethod
    def acquire(cls, store: Store, data_dir: str | Path, *, heartbeat_s: float = HEARTBEAT_S,
                on_lost: Callable[[LeaseRecord | None], None] | None = None) -> DatabaseLease:
        """Take the lease, or raise :class:`AlreadyServing` naming the live holder.

        Free: take it. Held by a process that can be checked from here: refuse if it is alive,
        take over if it is gone. Otherwise watch the holder's heartbeat: a renewal proves it
        alive (refuse); none for ``MISSED_HEARTBEATS`` periods means it is gone (take over).
        Every take is conditional on the row still naming the holder judged, so two starting
        servers cannot both win.
        """
        me = uuid.uuid4().hex
        who = dict(host=socket.gethostname(), pid=os.getpid(), pid_namespace=pid_namespace(),
                   data_dir=str(Path(data_dir).resolve()))
        seen: _Seen | None = None
        while True:
            current = store.get_lease()
            if current is None:
                if store.take_lease(me, **who):
                    break
                continue
            verdict = _judge(current, heartbeat_s)
            now = time.monotonic()
            if verdict == "unknown":
                if seen is None or seen.holder != current.holder:
                    seen = _Seen(current.holder, current.heartbeat_at, now)
                    log.debug("database lease held by %s: watching for a renewal",
                              _describe(current.host, current.pid))
                elif current.heartbeat_at != seen.heartbeat_at:
                    verdict = "alive"
                elif now - seen.since > MISSED_HEARTBEATS * heartbeat_s:
                    verdict = "gone"
            if verdict == "alive":
                raise AlreadyServing(
                    f"database {store.engine.url.render_as_string(hide_password=True)} is in use by another "
                    f"tinsmith server ({_describe(current.host, current.pid)}, data dir {current.data_dir}); "
                    "stop it first, or give this server its own --database-url"
                )
            if verdict == "gone":
                if store.take_lease(me, replacing=current.holder, **who):
                    log.warning("took over the database lease of a server that is gone (%s, data dir %s)",
                                _describe(current.host, current.pid), current.data_dir)
                    break
                seen = None
                continue  # someone else took it meanwhile: judge the new holder
            time.sleep(min(POLL_S, heartbeat_s / 2))
        lease = cls(store, me, who, heartbeat_s, on_lost or _log_only)
        lease._thread.start()
        return lease

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                held = self.store.renew_lease(self.holder)
                current = None if held else self.store.get_lease()
                if not held and current is None:  # the row was deleted by hand: nobody else holds it
                    held = self.store.take_lease(self.holder, **self._who)
                    current = None if held else self.store.get_lease()
            except Exception as e:  # noqa: BLE001 - a database hiccup: keep trying, the lease lasts a while
                log.warning("could not renew the database lease: %s", e)
                continue
            if not held:
                self.on_lost(current)
                return

    def release(self) -> None:
        """Stop renewing and give the lease back; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self.store.release_lease(self.holder)
        except Exception as e:  # noqa: BLE001 - the lease will be recognised as abandoned
            log.warning("could not release the database lease: %s", e)


def pid_namespace() -> str | None:
    """Where this process's pid names it: the kernel boot and the pid namespace (None off Linux).

    Two servers compare pids only when this matches: another container, another machine or a
    reboot gives the same numbers to unrelated processes.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{namespace}"


def _started_at(pid: int) -> datetime | None:
    """When process ``pid`` started (Linux ``/proc``), or None when that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return datetime.fromtimestamp(btime + ticks / os.sysconf("SC_CLK_TCK"), UTC)


Verdict = Literal["alive", "gone", "unknown"]


def _judge(lease: LeaseRecord, heartbeat_s: float) -> Verdict:
    """Whether the lease's holder is alive, gone, or cannot be checked from here."""
    age = (datetime.now(UTC) - lease.heartbeat_at).total_seconds()
    if age > max(STALE_AFTER_S, MISSED_HEARTBEATS * heartbeat_s):
        return "gone"
    here = pid_namespace()
    if here is None or lease.pid_namespace != here or lease.pid == os.getpid():
        # Its pid means nothing here; or it is ours, as for another server in this process.
        return "unknown"
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # exists, under another user
    started = _started_at(lease.pid)
    if started is None:
        return "unknown"
    if started > lease.acquired_at + timedelta(seconds=START_SLACK_S):
        return "gone"  # the pid was given to a process that started after the holder took the lease
    return "alive"


def _log_only(current: LeaseRecord | None) -> None:
    holder = "nobody" if current is None else _describe(current.host, current.pid)
    log.error("this server lost its database lease (now held by %s)", holder)
