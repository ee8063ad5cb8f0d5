"""A tensor-parallel rank that dies under a running server (``--tensor-parallel-size 2`` on the
CPU): the next request fails naming the rank, /healthz turns 503 with the reason, and later
requests fail at once instead of hanging."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tinsmith.api.app import create_app
from tinsmith.server.config import ServerConfig
from tinsmith.server.state import ServerState

KEY = {"X-API-Key": "tml-tp-fault"}
DATUM = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4, 5, 6], "dtype": "int64", "shape": [5]},
                            "weights": {"data": [1.0] * 5, "dtype": "float32", "shape": [5]}}}


@pytest.mark.parametrize("first", ["forward_backward", "asample"])
def test_a_dead_rank_fails_requests_and_turns_healthz_unhealthy(qwen3_dir, tmp_path, first):
    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)], data_dir=str(tmp_path), warm_up=False,
                                           device="cpu", tensor_parallel_size=2))
    with TestClient(create_app(state)) as client:
        def answer(path: str, body: dict) -> dict:
            rid = client.post(f"/api/v1/{path}", json=body, headers=KEY).json()["request_id"]
            r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=KEY)
            assert r.status_code == 200, r.text
            return r.json() if r.headers["content-type"].startswith("application/json") else {"bytes": r.content}

        session = client.post("/api/v1/create_session", json={"tags": []}, headers=KEY).json()["session_id"]
        model = answer("create_model", {"session_id": session, "model_seq_id": 1, "lora_config": {"rank": 4},
                                         "base_model": state.config.base_model[0]})["model_id"]
        fb = {"model_id": model, "seq_id": 1, "forward_backward_input": {"data": [DATUM], "loss_fn": "cross_entropy"}}
        assert "loss_fn_outputs" in answer("forward_backward", fb)
        sampler = client.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 2, "base_model": state.config.base_model[0]},
            headers=KEY).json()["sampling_session_id"]
        sample = {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 2, "type": "sample",
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                  "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 3}}
        assert "error" not in answer("asample", sample)
        assert client.get("/api/v1/healthz").status_code == 200

        follower = state.worker.tp_group.procs[0]
        follower.kill()
        follower.join()
        health = client.get("/api/v1/healthz")  # before any request meets the dead rank
        assert health.status_code == 503 and "rank 1 of 2" in health.json()["reason"]
        failed = answer(first, {**fb, "seq_id": 2} if first == "forward_backward" else {**sample, "seq_id": 2})
        assert "rank 1 of 2" in failed["error"] and "exited" in failed["error"], failed
        assert failed["category"] == "server"

        health = client.get("/api/v1/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and "rank 1 of 2" in health.json()["reason"]
        later = answer("optim_step", {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})
        assert "device failed" in later["error"] and "restarted" in later["error"]
