"""The sweeper drops old request payloads and schedules itself by the next session deadline."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from tinsmith.server.config import ServerConfig
from tinsmith.server.state import SESSION_SWEEP_SLACK_S, ServerState
from tinsmith.store import Store


@pytest.fixture
def make_state(tmp_path):
    made = []

    def make(**options) -> ServerState:
        store = Store(Store.default_sqlite_url(tmp_path / f"db{len(made)}"))
        store.migrate()
        state = ServerState(ServerConfig(data_dir=str(tmp_path), **options), store, worker=None, engine=None, auth=None)
        made.append(state)
        return state

    yield make
    for s in made:
        s.store.close()


def _finished_request(store: Store) -> str:
    rec, _ = store.create_request(owner="o", kind="forward", payload=b"p" * 100, payload_type="protobuf")
    store.complete_request(rec.request_id, b"r" * 100, "application/x-protobuf")
    return rec.request_id


def test_sweeper_drops_payloads_after_the_retention_time(make_state):
    retention = 0.5
    state = make_state(request_retention_s=retention)
    state.sweep_interval_s = 0.05
    rid = _finished_request(state.store)

    async def scenario():
        task = asyncio.create_task(state._sweeper())
        try:
            for _ in range(100):
                if state.store.get_request(rid).is_purged:
                    return
                await asyncio.sleep(0.05)
        finally:
            task.cancel()

    asyncio.run(scenario())
    rec = state.store.get_request(rid)
    assert rec.is_purged and rec.payload == b"" and rec.result is None and rec.status == "completed"
    assert (rec.purged_at - rec.completed_at).total_seconds() >= retention


def test_retention_zero_keeps_everything(make_state):
    state = make_state(request_retention_s=0)
    rid = _finished_request(state.store)
    assert state.purge_old_requests() == 0
    assert state.store.get_request(rid).result == b"r" * 100


def test_sleep_until_the_next_session_deadline(make_state):
    state = make_state(session_timeout_s=300)
    assert state._until_next_session_expiry() == 300  # no session: a new one is due in 300 s at the soonest
    state.store.create_session("o")
    assert 299 < state._until_next_session_expiry() <= 300 + SESSION_SWEEP_SLACK_S
    # a session whose last heartbeat was 250 s ago is due in 50 s
    with state.store.engine.begin() as conn:
        from sqlalchemy import update

        from tinsmith.store.tables import SessionTable

        conn.execute(update(SessionTable).values(last_heartbeat_at=datetime.now(UTC) - timedelta(seconds=250)))
    t0 = time.monotonic()
    wait = state._until_next_session_expiry()
    assert 49 < wait + (time.monotonic() - t0) <= 50 + SESSION_SWEEP_SLACK_S
