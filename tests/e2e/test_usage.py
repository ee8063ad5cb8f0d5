"""Per-key usage (AdminClient billing calls), session trace export, and what survives a restart
(usage counts, retrieve_futures cursors), through the unmodified SDK, its CLI and raw HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.e2e.conftest import KEY_A, KEY_B
from tests.e2e.helpers import RESULT_TIMEOUT_S, detail, lora_client, raw_client, session_id_of, sft_datum

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


@pytest.fixture(scope="module")
def usage_server(make_server, tmp_path_factory):
    """A two-key server of its own, so no other test's work shows in these counts."""
    keys = tmp_path_factory.mktemp("usage-keys") / "keys.txt"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    return make_server(api_keys_file=keys)


def _this_hour() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def _totals(admin: tinker.AdminClient) -> Counter:
    start = _this_hour() - timedelta(hours=1)
    usage = admin.get_billing_usage(starting_on=start, ending_before=start + timedelta(hours=3)).result(
        timeout=RESULT_TIMEOUT_S)
    totals: Counter = Counter()
    for e in usage.data:
        info = e.event_info
        kind = info.type + ("_cached" if getattr(info, "cached", False) else "")
        totals[kind] += info.token_count
        totals[("session", e.session_id)] += info.token_count
    return totals


def test_token_usage_per_key_survives_a_restart(usage_server, service_client, base_model):
    sc_a = service_client(usage_server, KEY_A)
    tc = lora_client(sc_a, base_model, rank=4, seed=1)
    data = [sft_datum(list(range(10, 22))), sft_datum(list(range(30, 37)))]  # 11 + 6 input tokens
    tc.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    tc.forward([sft_datum(list(range(40, 45)))], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)  # 4 more
    sampler = sc_a.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    for seed in range(3):
        sampler.sample(PROMPT, num_samples=2, sampling_params=types.SamplingParams(
            max_tokens=5, stop=[], seed=seed)).result(timeout=RESULT_TIMEOUT_S)
    sc_b = service_client(usage_server, KEY_B)
    lora_client(sc_b, base_model, rank=4, seed=2).forward(
        [sft_datum(list(range(50, 60)))], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)

    admin_a = tinker.AdminClient(base_url=usage_server.base_url, api_key=KEY_A)
    a = _totals(admin_a)
    # The prompt's 4 tokens are computed once: the later two calls take it whole from the first's
    # kept prefill (billed as cached).
    assert (a["training"], a["sampling_prefill"], a["sampling_sample"]) == (21, 4, 30)
    assert a["sampling_prefill_cached"] == 8
    assert a[("session", session_id_of(tc))] == 21 + 12 + 30  # one session did all of it
    b = _totals(tinker.AdminClient(base_url=usage_server.base_url, api_key=KEY_B))
    assert (b["training"], b["sampling_prefill"], b["sampling_sample"]) == (9, 0, 0)  # its own only

    usage_server.restart()
    assert _totals(tinker.AdminClient(base_url=usage_server.base_url, api_key=KEY_A)) == a


def test_checkpoint_storage_is_what_the_quota_counts(usage_server, service_client, base_model):
    sc = service_client(usage_server, KEY_B)
    admin = tinker.AdminClient(base_url=usage_server.base_url, api_key=KEY_B)
    before = admin.get_current_checkpoint_storage_usage().result(timeout=RESULT_TIMEOUT_S).data[0]
    tc = lora_client(sc, base_model, rank=4, seed=3)
    tc.save_state("usage-ck").result(timeout=RESULT_TIMEOUT_S)
    after = admin.get_current_checkpoint_storage_usage().result(timeout=RESULT_TIMEOUT_S).data[0]
    assert after.checkpoint_count == before.checkpoint_count + 1
    from tinsmith.store import Store

    with Store(Store.default_sqlite_url(usage_server.data_dir)) as store:
        ck = store.get_checkpoint(tc.model_id, "weights", "usage-ck")
        assert after.size_bytes - before.size_bytes == ck.size_bytes > 0
        assert after.size_bytes == store.owner_storage_bytes(ck.owner)  # the quota's own number
    assert after.size_gigabytes == pytest.approx(after.size_bytes / 1e9)
    other = tinker.AdminClient(base_url=usage_server.base_url, api_key=KEY_A)
    assert other.get_current_checkpoint_storage_usage(project_id="nowhere").result(
        timeout=RESULT_TIMEOUT_S).data[0].checkpoint_count == 0


def test_usage_bad_input(usage_server):
    hour = _this_hour()
    with raw_client(usage_server.base_url, KEY_A) as http:
        for params, field in [
            ({"starting_on": (hour + timedelta(minutes=5)).isoformat(), "ending_before": (hour + timedelta(hours=1)).isoformat()}, "starting_on"),
            ({"starting_on": hour.isoformat(), "ending_before": hour.isoformat()}, "ending_before"),
            ({"starting_on": hour.isoformat(), "ending_before": (hour + timedelta(days=15)).isoformat()}, "ending_before"),
            ({"starting_on": (hour + timedelta(hours=2)).isoformat(), "ending_before": (hour + timedelta(hours=3)).isoformat()}, "starting_on"),
            ({"starting_on": "yesterday", "ending_before": hour.isoformat()}, "starting_on"),
            ({"ending_before": hour.isoformat()}, "starting_on"),
        ]:
            r = http.get("/api/v1/billing/usage/events", params=params)
            assert r.status_code == 400, (params, r.text)
            assert field in detail(r), (field, detail(r))
        r = http.get("/api/v1/billing/usage/checkpoints/current", params={"project_id": ""})
        assert r.status_code == 400 and "project_id" in detail(r)
    with raw_client(usage_server.base_url, "tml-not-a-key") as http:
        assert http.get("/api/v1/billing/usage/checkpoints/current").status_code == 401


def test_export_trace_through_the_cli(usage_server, service_client, base_model, tmp_path):
    sc = service_client(usage_server, KEY_A)
    tc = lora_client(sc, base_model, rank=4, seed=4)
    tc.forward([sft_datum(list(range(10, 20)))], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    sid = session_id_of(tc)
    out = tmp_path / "trace.pftrace"
    env = {**os.environ, "TINKER_BASE_URL": usage_server.base_url, "TINKER_API_KEY": KEY_A, "TINKER_TELEMETRY": "0"}
    cli = Path(sys.executable).parent / "tinker"
    done = subprocess.run([str(cli), "session", "export-trace", sid, "--output", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = json.loads(out.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kinds = {e["name"] for e in slices}
    assert {"create_model", "forward", "queued"} <= kinds
    fwd = next(e for e in slices if e["name"] == "forward")
    assert fwd["args"]["status"] == "completed" and fwd["args"]["payload_bytes"] > 0
    # The work's own slice, from when the request left the queue (stored with its outcome) to its end.
    queued = next(e for e in slices if e["name"] == "queued" and e["args"]["request_id"] == fwd["args"]["request_id"])
    assert fwd["dur"] > 0 and queued["ts"] + queued["dur"] == fwd["ts"]
    assert fwd["args"]["result_bytes"] > 0 and "payload" not in fwd["args"]
    assert trace["metadata"]["session_id"] == sid
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert tc.model_id in threads

    with raw_client(usage_server.base_url, KEY_B) as other, raw_client(usage_server.base_url, KEY_A) as own:
        r = other.get(f"/api/v1/sessions/{sid}/trace_export")  # another key's session
        assert r.status_code == 404
        url = own.get(f"/api/v1/sessions/{sid}/trace_export").json()["url"]
        path = url.split(usage_server.base_url, 1)[1]
        session_part, expires, sig = path.rsplit("/", 3)[1:]
        assert other.get(path).status_code == 200  # the link is the permission
        assert other.get(path[:-1] + ("0" if sig[-1] != "0" else "1")).status_code == 403  # tampered
        assert other.get(path.replace(f"/{expires}/", f"/{int(expires) + 1}/")).status_code == 403
        r = own.get(f"/api/v1/sessions/no-such-session/trace_export")
        assert r.status_code == 404


def test_retrieve_futures_cursors_survive_a_restart(usage_server, service_client, base_model):
    """A SamplingClient made before a restart keeps sampling after it: its poller's cursor is a
    durable completion number, valid on the restarted server; raw polls see the same order."""
    from tests.e2e.test_futures import _asample, _poll, _sampler_session

    client = service_client(usage_server, KEY_A).create_sampling_client(base_model=base_model).result(
        timeout=RESULT_TIMEOUT_S)
    params = types.SamplingParams(max_tokens=3, stop=[], seed=1)
    before = client.sample(PROMPT, num_samples=1, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    with raw_client(usage_server.base_url, KEY_A) as http:
        sid = _sampler_session(http, base_model)
        first = [_asample(http, sid, i) for i in (1, 2)]
        seen, cursor = [], 0
        while len(seen) < 2:
            body = _poll(http, sid, cursor).json()
            seen += [c["request_id"] for c in body["completions"]]
            cursor = body["cursor"]
    usage_server.restart()
    after = client.sample(PROMPT, num_samples=1, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    assert list(after.sequences[0].tokens) == list(before.sequences[0].tokens)
    with raw_client(usage_server.base_url, KEY_A) as http:
        late = _asample(http, sid, 3)
        body = _poll(http, sid, cursor).json()  # the pre-restart cursor: only what finished since
        assert [c["request_id"] for c in body["completions"]] == [late] and body["cursor"] == cursor + 1
        everything = _poll(http, sid, 0, timeout=0).json()
        assert [c["request_id"] for c in everything["completions"]] == seen + [late]
