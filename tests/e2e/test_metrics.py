"""``/metrics`` and the request log of the real server, driven by the unmodified ``tinker`` SDK."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, lora_client, repeated_pattern_batch, train_steps
from tinsmith.tenants import key_id_for_api_key

pytestmark = pytest.mark.e2e

SECRET_KEY = "tml-e2e-metrics-secret-3f9a"


def scrape(base_url: str, **headers) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed with prometheus-client's parser."""
    r = httpx.get(base_url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_training_and_sampling_through_the_sdk_move_the_metrics(service_client, server, base_model):
    before = scrape(server.base_url)
    sc = service_client(api_key=SECRET_KEY)
    tc = lora_client(sc, base_model, rank=4, seed=1)
    data = repeated_pattern_batch(seed=2, n_seqs=2, seq_len=16, vocab=VOCAB)
    train_steps(tc, data, steps=2)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    tc.save_state("metrics-e2e-state").result(timeout=RESULT_TIMEOUT_S)
    out = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0)).result(
        timeout=RESULT_TIMEOUT_S)
    generated = sum(len(s.tokens) for s in out.sequences)
    after = scrape(server.base_url)

    def moved(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    fb_tokens = sum(d.model_input.length for d in data)
    assert moved("tinsmith_train_tokens_total", operation="forward_backward") >= 2 * fb_tokens
    assert moved("tinsmith_sampled_tokens_total") >= generated > 0
    for op in ("forward_backward", "optim_step", "sample", "save_weights", "save_weights_for_sampler"):
        assert moved("tinsmith_step_seconds_count", operation=op) >= 1, op
        assert moved("tinsmith_queue_wait_seconds_count", operation=op) >= 1, op
        assert moved("tinsmith_step_seconds_sum", operation=op) > 0, op
    assert moved("tinsmith_http_requests_total", route="/api/v1/forward_backward", status="200") >= 2
    assert moved("tinsmith_http_requests_total", route="/api/v1/asample", status="200") >= 1
    assert total(after, "tinsmith_training_runs", type="lora") >= 1
    assert total(after, "tinsmith_sampler_snapshots") >= 1
    assert total(after, "tinsmith_checkpoint_bytes", key_id="local") > 0
    # `tinsmith serve` took its start-up heap out of garbage collection (after one full collection,
    # counted with its pause) and counts the collector's pauses by generation.
    assert total(after, "tinsmith_gc_frozen_objects") > 10_000
    assert total(after, "tinsmith_gc_collections_total", generation="2") >= 1
    assert total(after, "tinsmith_gc_pause_seconds_total", generation="2") > 0
    assert {dict(labels).get("generation") for name, labels in after if name == "tinsmith_gc_collections_total"} == {
        "0", "1", "2"}

    # The request log: one line per request, the key by its id, never the key itself.
    log = server.log_text()
    assert SECRET_KEY not in log
    kid = key_id_for_api_key(SECRET_KEY)
    fb = [line for line in log.splitlines() if re.search(rf"request POST /api/v1/forward_backward 200 \S+ ms key={kid} "
                                                         rf"run=\S+ tokens={fb_tokens}$", line)]
    assert len(fb) >= 2, "\n".join(log.splitlines()[-40:])
    assert "dashboard at http://127.0.0.1:" in log  # the start-up summary names the dashboard's URL


def test_json_request_log_and_authenticated_metrics(make_server, tmp_path, base_model):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{SECRET_KEY}\n")
    srv = make_server(api_keys_file=keys, extra_args=["--log-format", "json", "--metrics-auth"])
    assert httpx.get(srv.base_url + "/metrics").status_code == 401
    http = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": SECRET_KEY}, timeout=30)
    session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    r = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 1, "base_model": base_model,
                                                "lora_config": {"rank": 4}})
    assert r.status_code == 200, r.text
    assert http.post("/api/v1/create_model", json={"session_id": session}).status_code == 400
    samples = scrape(srv.base_url, **{"Authorization": f"Bearer {SECRET_KEY}"})
    assert total(samples, "tinsmith_http_requests_total", route="/api/v1/create_model", status="400") == 1

    text = srv.log_text()
    assert SECRET_KEY not in text
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(lines) == len([line for line in text.splitlines() if line.strip()]), "a line that is not JSON"
    requests = [line for line in lines if line["logger"] == "tinsmith.requests"]
    created = [line for line in requests if line["route"] == "/api/v1/create_model"]
    assert [line["status"] for line in created] == [200, 400]
    assert created[0]["key_id"] == key_id_for_api_key(SECRET_KEY) and created[0]["level"] == "info"
    assert "base_model" in created[1]["reason"] or "session_id" in created[1]["reason"] or \
        "invalid request" in created[1]["reason"]
    assert any(line.get("dashboard", "").endswith("/dashboard") for line in lines)
