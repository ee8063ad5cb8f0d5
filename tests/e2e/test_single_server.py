"""One server per data directory and per database.

A second ``tinsmith serve`` on a data directory or a database that a live server holds exits
with one line on stderr naming the holder, before it recovers anything: the first server's runs
stay usable. After ``kill -9`` of the holder a new server starts at once (the OS dropped the
file lock; the database lease names a process that no longer exists). Runs on SQLite (one data
directory) and on PostgreSQL (two data directories sharing one database).
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import lora_client, sft_batch, train_steps
from tests.e2e.server import ServerError, ServerProcess
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

# A start after kill -9 of the holder is not held up by its leftovers: well under the 120 s after
# which a silent lease counts as gone (STALE_AFTER_S), with room for a start on a loaded machine.
RESTART_AFTER_KILL_S = 60.0


def _refusal(srv: ServerProcess) -> str:
    """Start ``srv``, expect it to exit during start-up; return its one line of output."""
    with pytest.raises(ServerError, match="exited with code"):
        srv.start()
    assert srv.proc.returncode not in (0, None)
    lines = srv.log_text().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _status(url: str, model_id: str) -> str:
    with Store(url) as store:
        return store.get_model(model_id).status


def _lease_holder(url: str):
    with Store(url) as store:
        return store.get_lease()


def _scenario(first: ServerProcess, second: ServerProcess, url: str, service_client, base_model: str,
              held: str) -> None:
    tc = lora_client(service_client(first), base_model, rank=4, seed=0)
    data = sft_batch(seed=1, n_seqs=2, seq_len=12, vocab=VOCAB)
    train_steps(tc, data, steps=1)
    lease = _lease_holder(url)
    assert lease is not None and lease.pid == first.proc.pid

    line = _refusal(second)
    assert line.startswith("tinsmith: ") and held in line, line
    assert f"pid {first.proc.pid}" in line and "stop it" in line, line
    assert "Traceback" not in line

    # the refused server recovered nothing: the first one's run is active and still trains
    assert _status(url, str(tc.model_id)) == "active"
    assert train_steps(tc, data, steps=1)[0] > 0
    assert _lease_holder(url).pid == first.proc.pid

    # kill -9: nothing is released by the holder, yet a new start goes through at once
    first.kill()
    t0 = time.monotonic()
    second.start()
    assert time.monotonic() - t0 < RESTART_AFTER_KILL_S, second.log_tail()
    assert _lease_holder(url).pid == second.proc.pid
    assert _status(url, str(tc.model_id)) == "lost"  # only now is the dead server's run recovered

    # a clean shutdown gives the lease back
    assert second.stop() in (0, -15) and not second.forced_kill, second.log_tail()
    assert _lease_holder(url) is None
    assert "Traceback" not in second.all_logs()


def test_one_server_per_data_dir(make_server, service_client, base_model):
    first = make_server()
    second = make_server(start=False, data_dir=first.data_dir)
    url = Store.default_sqlite_url(first.data_dir)
    _scenario(first, second, url, service_client, base_model, held=f"data dir {first.data_dir.resolve()}")


@pytest.mark.postgres
def test_one_server_per_database(make_server, service_client, base_model, postgres_url):
    first = make_server(database_url=postgres_url)
    second = make_server(start=False, database_url=postgres_url)  # a data dir of its own
    assert second.data_dir != first.data_dir
    try:
        _scenario(first, second, postgres_url, service_client, base_model, held="database")
    finally:
        first.stop()
        second.stop()  # before the scratch database is dropped
