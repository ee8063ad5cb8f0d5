"""Tenant isolation with ``--api-keys-file``: each key sees only its own sessions, runs and futures."""

from __future__ import annotations

import pytest
import tinker

from tests.e2e.conftest import KEY_A, KEY_B, VOCAB
from tests.e2e.helpers import (
    RESULT_TIMEOUT_S,
    detail,
    fb_proto_body,
    fb_result,
    logprobs_of,
    lora_client,
    post_fb,
    raw_client,
    session_id_of,
    sft_batch,
)

pytestmark = pytest.mark.e2e


def test_unlisted_key_is_rejected(restricted_server, base_model):
    with raw_client(restricted_server.base_url, "tml-not-listed") as http:
        r = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
        assert r.status_code == 401 and "not accepted" in detail(r)
        r = http.get("/api/v1/get_server_capabilities")
        assert r.status_code == 401
    with raw_client(restricted_server.base_url, KEY_A) as http:
        r = http.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": ""})
        assert r.status_code == 401
    sc = tinker.ServiceClient(base_url=restricted_server.base_url, api_key="tml-not-listed")
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=base_model, rank=4).result(timeout=RESULT_TIMEOUT_S)


def test_keys_cannot_reach_each_others_runs(restricted_server, service_client, base_model):
    tc_a = lora_client(service_client(restricted_server, KEY_A), base_model, rank=4, seed=0)
    tc_b = lora_client(service_client(restricted_server, KEY_B), base_model, rank=4, seed=0)
    model_a, session_a = str(tc_a.model_id), session_id_of(tc_a)
    data = sft_batch(seed=3, n_seqs=1, seq_len=8, vocab=VOCAB)

    url = restricted_server.base_url
    with raw_client(url, KEY_A) as http_a, raw_client(url, KEY_B) as http_b:
        # A submits a forward; its future is A's alone
        r = post_fb(http_a, fb_proto_body(model_a, 1, data, forward_only=True))
        assert r.status_code == 200, r.text
        rid_a = r.json()["request_id"]
        out_a = fb_result(http_a, rid_a)

        r = http_b.post("/api/v1/retrieve_future", json={"request_id": rid_a, "allow_metadata_only": False},
                        headers={"Accept": "application/x-protobuf"})
        assert r.status_code == 404 and rid_a in detail(r)

        r = http_b.post("/api/v1/get_info", json={"model_id": model_a, "type": "get_info"})
        assert r.status_code == 404 and model_a in detail(r)

        for forward_only in (True, False):
            r = post_fb(http_b, fb_proto_body(model_a, 2, data, forward_only=forward_only))
            assert r.status_code == 404 and model_a in detail(r)
        r = http_b.post("/api/v1/optim_step", json={"model_id": model_a, "seq_id": 2, "type": "optim_step",
                                                    "adam_params": {"learning_rate": 1.0}})
        assert r.status_code == 404

        r = http_b.post("/api/v1/create_model", json={"session_id": session_a, "model_seq_id": 5,
                                                      "base_model": base_model, "lora_config": {"rank": 4}})
        assert r.status_code == 404 and session_a in detail(r)
        r = http_b.post("/api/v1/session_heartbeat", json={"session_id": session_a})
        assert r.status_code == 404

        # listings are per key
        listed_a = http_a.get("/api/v1/sessions", params={"limit": 1000}).json()["sessions"]
        listed_b = http_b.get("/api/v1/sessions", params={"limit": 1000}).json()["sessions"]
        assert session_a in listed_a and session_a not in listed_b
        assert session_id_of(tc_b) in listed_b and session_id_of(tc_b) not in listed_a
        r = http_b.get(f"/api/v1/sessions/{session_a}")
        assert r.status_code == 404

    # the same through the SDK's REST client: B cannot see A's run, A can
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=url, api_key=KEY_B).get_training_run(model_a).result(timeout=RESULT_TIMEOUT_S)
    run = tinker.RestClient(base_url=url, api_key=KEY_A).get_training_run(model_a).result(timeout=RESULT_TIMEOUT_S)
    assert run.training_run_id == model_a

    # B's attempts changed nothing: A's run still gives the same forward
    again = tc_a.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert [x.tolist() for x in logprobs_of(again)] == [x.tolist() for x in logprobs_of(out_a)]
    # and B's own run works
    assert logprobs_of(tc_b.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0].shape == (8,)
