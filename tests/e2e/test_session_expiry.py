"""A session without heartbeats is finished within moments of ``--session-timeout-s``, not a
sweep period later; one that keeps sending them stays open past it."""

from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import json_result, raw_client
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

TIMEOUT_S = 2.0
ACCURACY_S = 1.5  # how late past its deadline a session may be finished


def test_sessions_expire_on_time(make_server, base_model):
    srv = make_server(extra_args=["--session-timeout-s", str(TIMEOUT_S)])
    url = Store.default_sqlite_url(srv.data_dir)
    with raw_client(srv.base_url) as http, Store(url) as store:
        def new_session() -> tuple[str, str]:
            sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
            r = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": base_model,
                                                        "lora_config": {"rank": 4}})
            assert r.status_code == 200, r.text
            json_result(http, r.json()["request_id"])
            return sid, r.json()["model_id"]

        kept, kept_model = new_session()
        silent, silent_model = new_session()
        # `kept` heartbeats for twice the timeout; `silent` never does
        until = time.monotonic() + 2 * TIMEOUT_S
        while time.monotonic() < until:
            assert http.post("/api/v1/session_heartbeat", json={"session_id": kept}).status_code == 200
            time.sleep(TIMEOUT_S / 4)
        done = store.get_session(silent)
        assert done.is_finished and done.finish_reason == "interrupted"
        assert TIMEOUT_S <= (done.finished_at - done.last_heartbeat_at).total_seconds() <= TIMEOUT_S + ACCURACY_S
        assert not store.get_session(kept).is_finished
        assert store.get_model(kept_model).status == "active"

        # now `kept` falls silent too: it is finished on time, its run unloaded
        deadline = time.monotonic() + TIMEOUT_S + ACCURACY_S + 2.0
        while not store.get_session(kept).is_finished and time.monotonic() < deadline:
            time.sleep(0.1)
        s = store.get_session(kept)
        assert s.is_finished, f"session not finished {TIMEOUT_S + ACCURACY_S + 2.0:.1f} s after its last heartbeat"
        assert TIMEOUT_S <= (s.finished_at - s.last_heartbeat_at).total_seconds() <= TIMEOUT_S + ACCURACY_S
        r = http.post("/api/v1/session_heartbeat", json={"session_id": kept})
        assert r.status_code == 410
        for model in (kept_model, silent_model):
            assert store.get_model(model).status == "unloaded"
