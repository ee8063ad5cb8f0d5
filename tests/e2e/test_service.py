"""Service endpoints through the SDK and raw HTTP: info, capabilities, sessions, telemetry, heartbeat."""

from __future__ import annotations

import pytest
import tinker

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (
    RESULT_TIMEOUT_S,
    detail,
    fb_proto_body,
    lora_client,
    post_fb,
    raw_client,
    session_id_of,
    sft_batch,
)

pytestmark = pytest.mark.e2e


def test_get_info(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=1)
    info = tc.get_info()
    assert info.model_id == tc.model_id
    assert str(info.model_id) == f"{session_id_of(tc)}:train:0"
    assert info.model_data.model_name == base_model
    assert info.model_data.arch == "qwen3"
    assert info.is_lora is True
    assert info.lora_rank == 8
    # a second training client of the same session gets the next model_seq_id
    tc2 = lora_client(sc, base_model, rank=2, seed=1)
    assert str(tc2.model_id) == f"{session_id_of(tc)}:train:1"
    assert tc2.get_info().lora_rank == 2


def test_server_capabilities(sc, server, base_model):
    with pytest.warns(Warning):  # deprecated on ServiceClient in 0.38, but still served
        caps = sc.get_server_capabilities()
    names = [m.model_name for m in caps.supported_models]
    assert names == [base_model]
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-e2e-local")
    rest_caps = rest.get_server_capabilities().result(timeout=RESULT_TIMEOUT_S)
    assert [m.model_name for m in rest_caps.supported_models] == [base_model]


def test_sessions_listed_and_described(sc, service_client, server, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=1)
    sid = session_id_of(tc)
    other = lora_client(service_client(), base_model, rank=4, seed=1)
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-e2e-local")
    listed = rest.list_sessions(limit=1000).result(timeout=RESULT_TIMEOUT_S).sessions
    assert sid in listed and session_id_of(other) in listed
    got = rest.get_session(sid).result(timeout=RESULT_TIMEOUT_S)
    assert got.training_run_ids == [tc.model_id]


def test_telemetry_accepted(server):
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/telemetry", json={"events": [{"event": "e2e", "severity": "INFO"}],
                                                 "platform": "linux", "sdk_version": "0.38.0",
                                                 "session_id": "sessionless-e2e"})
    assert r.status_code == 200
    assert r.json() == {"status": "accepted"}


def test_heartbeat_until_session_finished(service_client, server, base_model):
    sc = service_client()
    tc = lora_client(sc, base_model, rank=4, seed=1)
    sid, model_id = session_id_of(tc), str(tc.model_id)
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/session_heartbeat", json={"session_id": sid, "type": "session_heartbeat"})
        assert r.status_code == 200, r.text
        assert r.json() == {"type": "session_heartbeat"}

        sc.close("success").result(timeout=RESULT_TIMEOUT_S)
        # a finished session answers 410, which stops the SDK's heartbeat loop for good
        r = http.post("/api/v1/session_heartbeat", json={"session_id": sid, "type": "session_heartbeat"})
        assert r.status_code == 410, r.text
        assert sid in r.json()["detail"]

        r = http.post("/api/v1/session_heartbeat", json={"session_id": "no-such-session", "type": "session_heartbeat"})
        assert r.status_code == 404, r.text

        # a finished session takes no new runs, and its runs were released: a 4xx naming them
        r = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 1, "base_model": base_model,
                                                    "lora_config": {"rank": 4}})
        assert r.status_code == 400 and sid in detail(r) and "finished" in detail(r)
        r = post_fb(http, fb_proto_body(model_id, 1, sft_batch(0, 1, 4, VOCAB)))
        assert 400 <= r.status_code < 500 and model_id in detail(r), r.text
        r = http.post("/api/v1/get_info", json={"model_id": model_id})
        assert r.status_code == 200 and r.json()["model_id"] == model_id
