"""``/metrics`` in-process: it parses, its labels stay bounded, it moves with work, and the Grafana
dashboard shipped in docs/ queries only metrics it exposes."""

from __future__ import annotations

import gc
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tinsmith.api.app import create_app
from tinsmith.engine.scheduler import Job, Outcome
from tinsmith.server.config import ServerConfig
from tinsmith.server.logs import JsonFormatter, safe_database_url
from tinsmith.gc_tuning import PauseRecorder
from tinsmith.server import metrics as server_metrics
from tinsmith.server.metrics import OPERATIONS, ServerMetrics
from tinsmith.server.state import ServerState
from tinsmith.tenants import key_id, key_id_for_api_key
from tinsmith.api.auth import owner_for_key
from tinsmith.types import Datum, ForwardBackwardInput

import numpy as np

KEY = {"X-API-Key": "tml-metrics-unit"}
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",),
            "unknown": ("",), "stateset": ("",), "gaugehistogram": ("_bucket", "_gcount", "_gsum")}


def scrape(client: TestClient, **headers) -> dict:
    """family name -> family, parsed with prometheus-client's own parser."""
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels) -> float:
    family = families[re.sub(r"_(total|count|sum|bucket)$", "", sample)]
    found = [s.value for s in family.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"no sample {sample}{labels} in {[(s.name, s.labels) for s in family.samples]}"
    return sum(found)


def exposed_names(families: dict) -> set[str]:
    """Every series name a query may use: a family's name with its type's suffixes (a family
    without samples on this machine, such as device memory on a CPU host, still counts)."""
    return {f.name + suffix for f in families.values() for suffix in SUFFIXES[f.type]}


@pytest.fixture(scope="module")
def app(qwen3_dir, tmp_path_factory) -> Iterator[tuple[TestClient, ServerState]]:
    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)],
                                           data_dir=str(tmp_path_factory.mktemp("metrics"))))
    with TestClient(create_app(state)) as client:
        yield client, state


def test_metrics_parse_and_cover_the_server(app):
    client, _ = app
    families = scrape(client)
    for name in ("tinsmith_http_requests", "tinsmith_queue_depth", "tinsmith_queue_wait_seconds",
                 "tinsmith_step_seconds", "tinsmith_train_tokens", "tinsmith_sampled_tokens", "tinsmith_active_sessions",
                 "tinsmith_training_runs", "tinsmith_lora_adapters", "tinsmith_sampler_snapshots",
                 "tinsmith_kv_cache_bytes", "tinsmith_kv_cache_used_bytes", "tinsmith_prefix_cache_bytes", "tinsmith_process_memory_bytes", "tinsmith_host_memory_available_bytes",
                 "tinsmith_device_memory_used_bytes", "tinsmith_device_utilization_percent",
                 "tinsmith_checkpoint_bytes", "tinsmith_requests_in_flight"):
        assert name in families, name
    depth = {s.labels["operation"] for s in families["tinsmith_queue_depth"].samples}
    assert depth == set(OPERATIONS)
    assert value(families, "tinsmith_process_memory_bytes") > 0


def test_sampling_moves_the_prefill_and_prompt_cache_counters(app):
    """A prompt sampled twice: the second request's prompt comes from the prefix cache (16-token
    blocks, all but its last token), which the counters tell apart from computed tokens."""
    client, state = app
    before = scrape(client)
    session = client.post("/api/v1/create_session", json={"tags": []}, headers=KEY).json()["session_id"]
    sampler = client.post("/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": 1, "base_model": state.config.base_model[0]},
        headers=KEY).json()["sampling_session_id"]
    # The second prompt shares the first's two full blocks, not its end.
    for seq, tokens in ((1, list(range(7, 47))), (2, list(range(7, 39)) + list(range(200, 208)))):
        rid = client.post("/api/v1/asample", headers=KEY, json={
            "sampling_session_id": sampler, "seq_id": seq, "num_samples": 1, "type": "sample",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 3}}).json()["request_id"]
        r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=KEY)
        assert r.status_code == 200  # a sample's result is protobuf unless it failed (JSON)
        assert not r.headers["content-type"].startswith("application/json") or "error" not in r.json(), r.text
    after = scrape(client)

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("tinsmith_prefill_tokens_total") == 40 + 8  # the first prompt whole, then what follows 2 blocks
    assert moved("tinsmith_prompt_cache_hit_tokens_total") == 32
    assert moved("tinsmith_sampler_admissions_total") == 2
    assert moved("tinsmith_sampler_admitting_seconds_total") > 0  # the two admissions' host time
    assert value(after, "tinsmith_sampler_preemptions_total") == 0
    assert value(after, "tinsmith_decode_graph_replays_total") == 0  # graphs run on CUDA only
    # The engine's sampling slices are counted as its sampling turns' time; no training ran.
    assert value(after, "tinsmith_engine_turn_seconds_total", kind="sample") > value(
        before, "tinsmith_engine_turn_seconds_total", kind="sample")
    assert value(after, "tinsmith_engine_turn_seconds_total", kind="train") == 0
    assert value(after, "tinsmith_decode_graph_captures_total") == 0
    assert moved("tinsmith_sampler_prefills_total") == 2  # one admission per request, sent one after the other
    assert moved("tinsmith_decode_steps_total") >= 2  # two tokens each (the first comes with the prefill)
    # One read a step on a CPU (bursts of one step), never queued ahead of a read there.
    assert moved("tinsmith_decode_reads_total") == moved("tinsmith_decode_steps_total")
    assert value(after, "tinsmith_decode_bursts_ahead_total") == 0
    assert value(after, "tinsmith_prefix_cache_bytes") > 0


def test_routes_are_labelled_by_template_and_unknown_paths_share_one_label(app):
    client, _ = app
    assert client.get("/api/v1/training_runs/run-does-not-exist", headers=KEY).status_code == 404
    assert client.get("/no/such/path/123").status_code == 404
    families = scrape(client)
    routes = {s.labels["route"] for s in families["tinsmith_http_requests"].samples}
    assert "/api/v1/training_runs/{run_id}" in routes
    assert "unmatched" in routes
    assert not any("run-does-not-exist" in r or "123" in r for r in routes)


def test_work_moves_the_counters_and_a_checkpoint_shows_under_its_key_id(app):
    client, state = app
    before = scrape(client)
    session = client.post("/api/v1/create_session", json={"tags": []}, headers=KEY).json()["session_id"]

    def done(answer: dict) -> dict:
        r = client.post("/api/v1/retrieve_future", json={"request_id": answer["request_id"]}, headers=KEY)
        assert r.status_code == 200, r.text
        return r.json()

    model = done(client.post("/api/v1/create_model", headers=KEY, json={
        "session_id": session, "model_seq_id": 1, "base_model": state.config.base_model[0],
        "lora_config": {"rank": 4}}).json())["model_id"]
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4, 5, 6], "dtype": "int64", "shape": [5]},
                                "weights": {"data": [1.0] * 5, "dtype": "float32", "shape": [5]}}}
    done(client.post("/api/v1/forward_backward", headers=KEY, json={
        "model_id": model, "seq_id": 1, "forward_backward_input": {"data": [datum, datum], "loss_fn": "cross_entropy"}
    }).json())
    done(client.post("/api/v1/optim_step", headers=KEY, json={
        "model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}).json())
    done(client.post("/api/v1/save_weights", headers=KEY, json={"model_id": model, "path": "m1", "seq_id": 3}).json())
    after = scrape(client)

    assert value(after, "tinsmith_train_tokens_total", operation="forward_backward") - \
        value(before, "tinsmith_train_tokens_total", operation="forward_backward") == 10
    for op in ("create_model", "forward_backward", "optim_step", "save_weights"):
        assert value(after, "tinsmith_step_seconds_count", operation=op) > \
            value(before, "tinsmith_step_seconds_count", operation=op), op
        assert value(after, "tinsmith_queue_wait_seconds_count", operation=op) > \
            value(before, "tinsmith_queue_wait_seconds_count", operation=op), op
        assert value(after, "tinsmith_operations_total", operation=op, outcome="ok") >= 1
    assert value(after, "tinsmith_http_requests_total", route="/api/v1/forward_backward", status="200") >= 1
    assert value(after, "tinsmith_training_runs", type="lora") >= 1
    assert value(after, "tinsmith_active_sessions") >= 1
    kid = key_id_for_api_key(KEY["X-API-Key"])
    assert value(after, "tinsmith_checkpoint_bytes", key_id="local") > 0  # single-user mode: one tenant
    assert kid not in {s.labels.get("key_id") for s in after["tinsmith_checkpoint_bytes"].samples}
    assert KEY["X-API-Key"] not in client.get("/metrics").text


def test_grafana_dashboard_queries_only_exposed_metrics(app):
    client, _ = app
    exposed = exposed_names(scrape(client))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    functions = {"rate", "irate", "increase", "sum", "by", "histogram_quantile", "le", "max", "min", "avg",
                 "without", "clamp_min", "topk", "or", "and", "on", "count"}
    used = set()
    for expr in exprs:
        stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)  # label matchers, ranges, strings
        used |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped) if w not in functions
                 and not re.fullmatch(r"\d.*", w)} - {"operation", "route", "status", "type", "state", "device",
                                                       "key_id", "stored", "outcome", "method", "generation",
                                                       "kind"}
    assert used, exprs
    assert used <= exposed, sorted(used - exposed)


def test_metrics_show_the_collector_only_where_its_pauses_are_counted(app, monkeypatch):
    client, _ = app
    recorder = PauseRecorder()
    monkeypatch.setattr(server_metrics, "PAUSES", recorder)

    def families() -> dict:
        text = client.get("/metrics", headers=KEY).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    # A server embedded in another program: the collector is that program's, nothing is reported.
    assert not families()["tinsmith_gc_collections"].samples
    recorder.install()
    try:
        gc.collect(2)
        found = families()
        by_generation = {s.labels["generation"]: s.value for s in found["tinsmith_gc_collections"].samples
                         if s.name.endswith("_total")}
        assert set(by_generation) == {"0", "1", "2"} and by_generation["2"] >= 1
        paused = sum(s.value for s in found["tinsmith_gc_pause_seconds"].samples if s.name.endswith("_total"))
        assert paused > 0
        assert [s.value for s in found["tinsmith_gc_frozen_objects"].samples] == [gc.get_freeze_count()]
    finally:
        gc.callbacks.remove(recorder._on_collection)


def test_a_devices_allocator_retries_and_frees_are_counters(app, monkeypatch):
    """What the caching allocator's cudaFree calls cost (each waits for the whole device) shows as
    two counters per device; a reading that has none leaves them out."""
    from tinsmith.server import health

    client, _ = app
    reading = health.DeviceReading(index=0, name="GPU", total_bytes=80 << 30, allocated_bytes=1 << 30,
                                   reserved_bytes=2 << 30, allocator_retries=3, device_frees=7)
    real = health.read_health()
    monkeypatch.setattr(server_metrics, "read_health", lambda: health.HealthReading(
        real.process_rss_bytes, real.host_total_bytes, real.host_available_bytes, real.cpu_percent, [reading]))
    families = scrape(client, **KEY)
    assert value(families, "tinsmith_device_allocator_retries_total", device="0") == 3
    assert value(families, "tinsmith_device_frees_total", device="0") == 7
    assert value(families, "tinsmith_device_memory_reserved_bytes", device="0") == 2 << 30
    reading.allocator_retries = reading.device_frees = None  # unreadable: absent, never a made-up zero
    families = scrape(client, **KEY)
    assert not families["tinsmith_device_allocator_retries"].samples and not families["tinsmith_device_frees"].samples


def test_two_servers_in_one_process_keep_their_own_registries():
    one, two = ServerMetrics(), ServerMetrics()
    one.observe_request("/x", "GET", 200, 0.01)
    assert one.registry.get_sample_value("tinsmith_http_requests_total", {"route": "/x", "method": "GET",
                                                                            "status": "200"}) == 1
    assert two.registry.get_sample_value("tinsmith_http_requests_total", {"route": "/x", "method": "GET",
                                                                            "status": "200"}) is None


def test_observe_job_records_wait_run_and_tokens():
    m = ServerMetrics()
    data = [Datum(np.arange(7), {}), Datum(np.arange(3), {})]
    job = Job("r1", "forward_backward", "m", 1, ForwardBackwardInput(data, "cross_entropy"))
    job.enqueued_at, job.started_at, job.finished_at = 10.0, 10.5, 12.0
    m.observe_job(job, Outcome(result=b"{}"))
    failed = Job("r2", "optim_step", "m", 2, None)
    failed.started_at = failed.finished_at = failed.enqueued_at
    m.observe_job(failed, Outcome(error="bad", category="user"))
    get = m.registry.get_sample_value
    assert get("tinsmith_queue_wait_seconds_sum", {"operation": "forward_backward"}) == pytest.approx(0.5)
    assert get("tinsmith_step_seconds_sum", {"operation": "forward_backward"}) == pytest.approx(1.5)
    assert get("tinsmith_train_tokens_total", {"operation": "forward_backward"}) == 10
    assert get("tinsmith_operations_total", {"operation": "optim_step", "outcome": "user"}) == 1


def test_metrics_auth_requires_an_accepted_key(qwen3_dir, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("tml-metrics-reader\n")
    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)], data_dir=str(tmp_path / "d"),
                                           api_keys_file=str(keys), metrics_auth=True))
    with TestClient(create_app(state)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"X-API-Key": "tml-wrong"}).status_code == 401
        assert client.get("/metrics", headers={"X-API-Key": "tml-metrics-reader"}).status_code == 200
        assert client.get("/metrics", headers={"Authorization": "Bearer tml-metrics-reader"}).status_code == 200


def test_key_ids_are_short_stable_and_match_their_owner():
    key = "tml-secret-value-1234"
    assert key_id(owner_for_key(key)) == key_id_for_api_key(key)
    assert len(key_id_for_api_key(key)) == 8 and key_id_for_api_key(key) not in key
    assert key_id("local") == "local" and key_id("") == "-"


def test_json_log_lines_carry_their_fields():
    record = logging.LogRecord("tinsmith.requests", logging.INFO, __file__, 1, "request %s", ("x",), None)
    record.fields = {"route": "/api/v1/sample", "status": 200, "key_id": "abcd1234"}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request x" and line["level"] == "info" and line["route"] == "/api/v1/sample"
    assert time.strptime(line["time"][:19], "%Y-%m-%dT%H:%M:%S")


def test_database_urls_are_logged_without_their_password():
    shown = safe_database_url("postgresql+psycopg://tinsmith:hunter2@db:5432/tinsmith")
    assert "hunter2" not in shown and "db:5432" in shown


def test_sampler_rows_are_reported_by_key(app):
    """Each key's rows decoding and rows waiting (in a sampler's queue, or not yet handed to one),
    with ``num_samples`` counting as that many rows."""
    from types import SimpleNamespace

    from tinsmith.sampling.sampler import SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    def inp(n: int) -> SampleInput:
        return SampleInput(np.arange(4), n, SamplingParams(max_tokens=2))

    def row(owner: str):
        return SimpleNamespace(state=SimpleNamespace(task=SampleTask("k", None, inp(1), owner)))

    sampler = SimpleNamespace(rows=[row("key-a"), row("key-a"), row("key-b")], inbox=[SampleTask("k", None, inp(3), "key-b")])
    queued = SimpleNamespace(owner="key-a", args=SimpleNamespace(input=inp(2)))
    assert server_metrics._key_rows([sampler], [queued]) == {
        ("key-a", "decoding"): 2, ("key-b", "decoding"): 1, ("key-b", "waiting"): 3, ("key-a", "waiting"): 2}
    assert "tinsmith_sampler_key_rows" in scrape(app[0])
