"""A device that fails mid-step: the request says what happened, /healthz turns 503 with the
reason, later requests fail at once naming it, and the HTTP side stays up.

On a CPU the failure is played by the model raising the error CUDA raises after an illegal
memory access (sticky: every later kernel would fail the same way).
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from tinsmith.api.app import create_app
from tinsmith.server.config import ServerConfig
from tinsmith.server.state import ServerState

KEY = {"X-API-Key": "tml-device-fault"}
DATUM = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4, 5, 6], "dtype": "int64", "shape": [5]},
                            "weights": {"data": [1.0] * 5, "dtype": "float32", "shape": [5]}}}


def test_a_failed_device_is_reported_and_nothing_hangs(qwen3_dir, tmp_path):
    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)], data_dir=str(tmp_path), warm_up=False))
    with TestClient(create_app(state)) as client:
        def answer(path: str, body: dict) -> dict:
            rid = client.post(f"/api/v1/{path}", json=body, headers=KEY).json()["request_id"]
            r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=KEY)
            assert r.status_code == 200, r.text
            return r.json()

        assert client.get("/api/v1/healthz").status_code == 200
        session = client.post("/api/v1/create_session", json={"tags": []}, headers=KEY).json()["session_id"]
        model = answer("create_model", {"session_id": session, "model_seq_id": 1, "lora_config": {"rank": 4},
                                         "base_model": state.config.base_model[0]})["model_id"]
        base = next(iter(state.worker.bases.values())).loaded.model

        def lost(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        base.hidden_states = lost
        failed = answer("forward_backward", {"model_id": model, "seq_id": 1, "forward_backward_input": {
            "data": [DATUM], "loss_fn": "cross_entropy"}})
        assert "illegal memory access" in failed["error"] and failed["category"] == "server"

        health = client.get("/api/v1/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and "illegal memory access" in health.json()["reason"]
        later = answer("optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
        assert "device failed" in later["error"] and "restarted" in later["error"]
        assert client.get("/metrics").status_code == 200
