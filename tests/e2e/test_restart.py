"""Restart recovery: ``kill -9`` the server mid-run, start it again on the same store, then once
more after a graceful stop with work queued.

Completed futures stay retrievable byte for byte, requests cut off by a stop fail with a clear
message (never a future that hangs), and the run whose adapter lived only in memory answers a
4xx naming it. The same scenario runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (
    PROTOBUF,
    RESULT_TIMEOUT_S,
    detail,
    fb_proto_body,
    json_result,
    logprobs_of,
    lora_client,
    post_fb,
    raw_client,
    retrieve,
    session_id_of,
    sft_batch,
    train_steps,
)
from tests.e2e.server import ServerProcess
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

RESTART_MESSAGE = "the server restarted while this"


def _unfinished(store_url: str) -> dict[str, str]:
    """request_id -> kind of every pending/running request, read straight from the store."""
    store = Store(store_url)
    try:
        return {r.request_id: r.kind for r in store.list_unfinished_requests()}
    finally:
        store.close()


def _optim(http, model_id: str, seq_id: int):
    return http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id, "type": "optim_step",
                                                 "adam_params": {"learning_rate": 1e-3}})


def _slow_batch(n_seqs: int):
    """A forward_backward that takes seconds on the tiny model (long sequences)."""
    return sft_batch(seed=3, n_seqs=n_seqs, seq_len=500, vocab=VOCAB)


def _assert_cut_off(http, request_id: str, kind: str, model_id: str) -> None:
    failure = json_result(http, request_id)
    assert set(failure) == {"error", "category"}, failure
    assert RESTART_MESSAGE in failure["error"] and kind in failure["error"], failure
    assert model_id in failure["error"]
    assert failure["category"] == "server"


def run_restart_scenario(srv: ServerProcess, service_client, base_model: str, store_url: str, *,
                         graceful: bool) -> None:
    # ------------------------------------------------------------------ before the kill
    sc = service_client(srv)
    tc = lora_client(sc, base_model, rank=4, seed=0)
    model_id = str(tc.model_id)
    losses = train_steps(tc, sft_batch(seed=1, n_seqs=2, seq_len=16, vocab=VOCAB), steps=3, lr=5e-3)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # basic SFT works on this store

    saved = tc.save_state("before-kill").result(timeout=RESULT_TIMEOUT_S).path
    assert saved == f"tinker://{model_id}/weights/before-kill"

    probe = sft_batch(seed=2, n_seqs=2, seq_len=12, vocab=VOCAB)
    with raw_client(srv.base_url) as http:
        # two completed futures: a forward (protobuf result) and an optim_step (JSON result)
        r = post_fb(http, fb_proto_body(model_id, 100, probe, forward_only=True))
        assert r.status_code == 200, r.text
        done_fwd = r.json()["request_id"]
        before_fwd = retrieve(http, done_fwd)
        assert before_fwd.status_code == 200 and before_fwd.headers["content-type"].startswith(PROTOBUF)
        done_opt = _optim(http, model_id, 101).json()["request_id"]
        before_opt = json_result(http, done_opt)
        assert "grad_norm" in before_opt["metrics"]  # (zero: no gradient since the last step)

        # work that takes seconds, and a request queued behind it; then kill -9 at once
        slow = post_fb(http, fb_proto_body(model_id, 102, _slow_batch(16))).json()["request_id"]
        queued = _optim(http, model_id, 103).json()["request_id"]
    srv.kill()

    in_flight = _unfinished(store_url)
    assert {slow, queued} <= set(in_flight), in_flight
    assert done_fwd not in in_flight and done_opt not in in_flight

    # ------------------------------------------------------------------ after the kill
    srv.start()
    assert _unfinished(store_url) == {}  # nothing is left pending once the server is up

    with raw_client(srv.base_url) as http:
        # completed futures: the very same answer
        after_fwd = retrieve(http, done_fwd)
        assert after_fwd.status_code == 200
        assert after_fwd.headers["content-type"] == before_fwd.headers["content-type"]
        assert after_fwd.content == before_fwd.content
        assert json_result(http, done_opt) == before_opt

        # cut-off requests: a failed future saying why, naming the model
        _assert_cut_off(http, slow, "forward_backward", model_id)
        _assert_cut_off(http, queued, "optim_step", model_id)

        # the run is still known (get_info works) but its unsaved adapter is gone: 4xx naming it
        r = http.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"})
        assert r.status_code == 200 and r.json()["model_id"] == model_id
        r = post_fb(http, fb_proto_body(model_id, 104, probe))
        assert r.status_code == 410 and model_id in detail(r)

    # the SDK client from before the kill reconnects and gets the same clear error, no hang
    with pytest.raises(tinker.APIStatusError) as exc:
        tc.forward_backward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert exc.value.status_code == 410 and model_id in str(exc.value)
    with pytest.raises(tinker.APIStatusError) as exc:
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
    assert exc.value.status_code == 410 and model_id in str(exc.value)

    # what was saved before the kill resumes exactly where it was (the probe ran after the save)
    resumed = sc.create_training_client_from_state_with_optimizer(saved).result(timeout=RESULT_TIMEOUT_S)
    got = logprobs_of(resumed.forward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    want = logprobs_of(deserialize_forward_backward_output(before_fwd.content))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert train_steps(resumed, probe, steps=1)[0] > 0

    # new work is fine, in the old session and in a new one
    again = lora_client(sc, base_model, rank=4, seed=0)
    assert logprobs_of(again.forward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0].shape == (12,)
    fresh = lora_client(service_client(srv), base_model, rank=4, seed=0)
    fresh_id = str(fresh.model_id)
    assert train_steps(fresh, probe, steps=1)[0] > 0

    assert "Traceback" not in srv.all_logs()
    if not graceful:
        return

    # ------------------------------------------------------------------ graceful stop with work queued
    with raw_client(srv.base_url) as http:
        running = post_fb(http, fb_proto_body(fresh_id, 3, _slow_batch(16))).json()["request_id"]
        waiting = _optim(http, fresh_id, 4).json()["request_id"]  # waits for the run's previous call
    assert srv.stop(timeout=60) in (0, -15) and not srv.forced_kill, srv.log_tail()
    assert "Application shutdown complete" in srv.log_text()
    srv.start()
    with raw_client(srv.base_url) as http:
        # The call that was executing may have finished before or during shutdown; the queued
        # one can only have run after it (per-run order), and otherwise was cut off cleanly.
        r = retrieve(http, running)
        if r.headers["content-type"].startswith(PROTOBUF):
            w = json_result(http, waiting)
            if "metrics" not in w:
                _assert_cut_off(http, waiting, "optim_step", fresh_id)
        else:
            _assert_cut_off(http, running, "forward_backward", fresh_id)
            _assert_cut_off(http, waiting, "optim_step", fresh_id)
        # the record of both sessions and runs survived both restarts
        sessions = http.get("/api/v1/sessions", params={"limit": 1000}).json()["sessions"]
        assert session_id_of(tc) in sessions and session_id_of(fresh) in sessions
        for m in (model_id, fresh_id):
            r = http.post("/api/v1/get_info", json={"model_id": m})
            assert r.status_code == 200 and r.json()["lora_rank"] == 4
    assert "Traceback" not in srv.all_logs()


def test_restart_recovery_sqlite(make_server, service_client, base_model):
    srv = make_server()
    run_restart_scenario(srv, service_client, base_model, Store.default_sqlite_url(srv.data_dir), graceful=True)


@pytest.mark.postgres
def test_restart_recovery_postgres(make_server, service_client, base_model, postgres_url):
    srv = make_server(database_url=postgres_url)
    try:
        # kill -9 and restart only: the graceful stop is the same code on either store
        run_restart_scenario(srv, service_client, base_model, postgres_url, graceful=False)
    finally:
        srv.stop()  # before the scratch database is dropped
