"""Per-key limits with ``--api-keys-file``: what one key does never breaks another key's work.

Each test starts a server of its own with the caps it needs, set through ``TINSMITH_*``
environment variables, and drives it with two keys through the unmodified SDK (and raw HTTP
where the status code itself is what is checked).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import KEY_A, KEY_B, VOCAB
from tests.e2e.helpers import (
    RESULT_TIMEOUT_S,
    detail,
    lora_adapter_bytes,
    lora_client,
    raw_client,
    retrieve,
    sft_batch,
    train_steps,
)
from tests.e2e.server import ServerProcess
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
DATA = sft_batch(seed=71, n_seqs=2, seq_len=8, vocab=VOCAB)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limit-keys") / "api-keys.txt"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    return path


def _server(make_server, keys_file: Path, **options) -> ServerProcess:
    """A server accepting KEY_A and KEY_B, with ``options`` as ``TINSMITH_<NAME>`` variables."""
    return make_server(api_keys_file=keys_file, env={"TINSMITH_" + k.upper(): str(v) for k, v in options.items()})


# ------------------------------------------------------------------------------ runs held
def test_one_key_cannot_take_every_run_slot(make_server, keys_file, service_client, base_model):
    srv = _server(make_server, keys_file, max_training_runs=3, max_runs_per_key=2)
    sc_a = service_client(srv, KEY_A)
    runs_a = [lora_client(sc_a, base_model, seed=i) for i in range(2)]
    state = runs_a[0].save_state("cap").result(timeout=RESULT_TIMEOUT_S).path

    # Both ways of making a run are refused with a clear error at once (no retrying for minutes).
    for create in (lambda: lora_client(sc_a, base_model, seed=2),
                   lambda: sc_a.create_training_client_from_state(state).result(timeout=RESULT_TIMEOUT_S)):
        start = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as exc:
            create()
        assert "--max-runs-per-key 2" in str(exc.value)
        assert time.monotonic() - start < 10

    # The other key gets the slot A could not take, and A's runs carry on untouched.
    tc_b = lora_client(service_client(srv, KEY_B), base_model, seed=5)
    assert np.isfinite(train_steps(tc_b, DATA, 1)).all()
    assert np.isfinite(train_steps(runs_a[1], DATA, 1)).all()

    # Closing a client frees its runs: A can create again.
    sc_a.close("success").result(timeout=RESULT_TIMEOUT_S)
    tc_a = lora_client(service_client(srv, KEY_A), base_model, seed=6)
    assert np.isfinite(train_steps(tc_a, DATA, 1)).all()


# ------------------------------------------------------------------------------ requests in flight
def _long_sample(base_model: str) -> dict:
    """An asample body that keeps the sampler busy for a while (many rows, never stops early)."""
    return {"base_model": base_model, "num_samples": 8, "prompt": {"chunks": [{"type": "encoded_text",
            "tokens": [5, 6, 7]}]}, "sampling_params": {"max_tokens": 500, "stop": []}, "type": "sample"}


def test_requests_beyond_the_in_flight_cap_get_a_429_that_the_sdk_rides_out(make_server, keys_file, service_client,
                                                                              base_model):
    srv = _server(make_server, keys_file, max_requests_in_flight_per_key=2, log_level="debug")
    sampler = service_client(srv, KEY_A).create_sampling_client(base_model=base_model).result(
        timeout=RESULT_TIMEOUT_S)
    body = _long_sample(base_model)
    with raw_client(srv.base_url, KEY_A) as http_a, raw_client(srv.base_url, KEY_B) as http_b:
        first = [http_a.post("/api/v1/asample", json=body) for _ in range(2)]
        assert [r.status_code for r in first] == [200, 200], [r.text for r in first]
        r = http_a.post("/api/v1/asample", json=body)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert "--max-requests-in-flight-per-key 2" in detail(r)
        # a new run is refused before it is recorded: no run is left behind without its create
        session = http_a.post("/api/v1/create_session", json={}).json()["session_id"]
        r = http_a.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": base_model,
                                                      "lora_config": {"rank": 4}})
        assert r.status_code == 429, r.text
        with Store(Store.default_sqlite_url(srv.data_dir)) as store:
            assert store.list_session_models(session) == []
        # the other key is not held back by A's queue
        r_b = http_b.post("/api/v1/asample", json=body)
        assert r_b.status_code == 200, r_b.text

        # Through the SDK the 429s stay invisible: while A's two long requests hold its slots,
        # the SDK's submissions are refused; it backs off and resubmits until each goes through.
        log_start = len(srv.log_text())
        params = types.SamplingParams(max_tokens=16, temperature=1.0, stop=[])
        futures = [sampler.sample(PROMPT, 2, params) for _ in range(4)]
        for f in futures:
            assert [len(s.tokens) for s in f.result(timeout=RESULT_TIMEOUT_S).sequences] == [16, 16]
        assert "request POST /api/v1/asample 429" in srv.log_text()[log_start:]  # the SDK was refused, and rode it out

        for http, rid in [(http_a, r.json()["request_id"]) for r in first] + [(http_b, r_b.json()["request_id"])]:
            assert retrieve(http, rid).status_code == 200


# ------------------------------------------------------------------------------ request rate
def test_a_key_above_its_request_rate_is_held_back_only_while_another_key_is_served(make_server, keys_file,
                                                                                   service_client, base_model):
    srv = _server(make_server, keys_file, max_requests_per_second_per_key=2, request_burst_per_key=4,
                  log_level="debug")
    caps = "/api/v1/get_server_capabilities"
    with raw_client(srv.base_url, KEY_A) as http_a, raw_client(srv.base_url, KEY_B) as http_b:
        assert [http_a.get(caps).status_code for _ in range(12)] == [200] * 12  # alone: never refused
        assert http_b.get(caps).status_code == 200  # now B is being served, and A's bucket is empty
        tries = [http_a.get(caps) for _ in range(3)]  # (a slow box may have refilled one request's worth)
        r = next((t for t in tries if t.status_code == 429), tries[-1])
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert "--max-requests-per-second-per-key" in detail(r)
        assert http_b.get(caps).status_code == 200  # B's own bucket is untouched by A's

        # While B keeps being served, the SDK of A is refused again and again, and rides it out.
        stop, b_statuses = threading.Event(), []

        def keep_b_busy() -> None:
            while not stop.wait(0.5):
                b_statuses.append(http_b.get(caps).status_code)

        busy = threading.Thread(target=keep_b_busy)
        busy.start()
        try:
            log_start = len(srv.log_text())
            sampler = service_client(srv, KEY_A).create_sampling_client(base_model=base_model).result(
                timeout=RESULT_TIMEOUT_S)
            futures = [sampler.sample(PROMPT, 1, GREEDY) for _ in range(4)]
            assert [len(f.result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens) for f in futures] == [4] * 4
        finally:
            stop.set()
            busy.join()
        assert b_statuses and set(b_statuses) == {200}, b_statuses  # B never refused meanwhile
        log = srv.log_text()
        assert "DEBUG tinsmith.requests: request POST /api/v1/asample 429" in log[log_start:]  # each refusal, at debug
        assert "WARNING tinsmith.api.request_rates: key " in log  # and their sum, at warning


# ------------------------------------------------------------------------------ sampler snapshots
def test_another_keys_snapshots_never_evict_a_sampler_in_use(make_server, keys_file, service_client, base_model):
    # The server-wide cap at its default (64); the per-key cap above it, so the server-wide one
    # is what B runs into.
    srv = _server(make_server, keys_file, max_sampler_snapshots_per_key=1000)
    tc_a = lora_client(service_client(srv, KEY_A), base_model, seed=1)
    tc_b = lora_client(service_client(srv, KEY_B), base_model, seed=2)
    train_steps(tc_a, DATA, 1, lr=0.1)
    sampler_a = tc_a.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    before = sampler_a.sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens

    samplers_b = [tc_b.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S) for _ in range(64)]

    # A's sampler, used a moment ago, survived B filling the server, and still samples A's weights.
    assert sampler_a.sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens == before
    # B made room from its own snapshots: its newest works, its oldest (in memory only) is gone, clearly.
    assert len(samplers_b[-1].sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens) == 4
    with pytest.raises(tinker.RequestFailedError, match="no longer held"):
        samplers_b[0].sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S)


# ------------------------------------------------------------------------------ checkpoint storage
def test_checkpoint_quota_counts_every_byte_written_for_the_key(make_server, keys_file, service_client, base_model,
                                                                 tiny_model):
    adapter = lora_adapter_bytes(tiny_model, rank=4)  # a sampler-weights save; a state save is about 4x
    srv = _server(make_server, keys_file, checkpoint_quota_bytes=6 * adapter)
    sc_a = service_client(srv, KEY_A)
    tc_a = lora_client(sc_a, base_model, rank=4, seed=1)
    train_steps(tc_a, DATA, 1)  # so that a state save holds the Adam moments too

    state = tc_a.save_state("s1").result(timeout=RESULT_TIMEOUT_S).path  # ~4 of 6 adapters' worth
    tc_a.save_weights_for_sampler("w1").result(timeout=RESULT_TIMEOUT_S)  # ~5 of 6
    # named sampler weights are written to disk: they count like any other checkpoint
    with pytest.raises(tinker.RequestFailedError, match="quota"):
        tc_a.save_weights_for_sampler("w2").result(timeout=RESULT_TIMEOUT_S)
    # a save is refused for the bytes it is about to write, even while the key is below its quota
    with pytest.raises(tinker.RequestFailedError, match="quota"):
        tc_a.save_state("s2").result(timeout=RESULT_TIMEOUT_S)
    # an in-memory sampler writes nothing, so it is still allowed
    sampler = tc_a.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    assert len(sampler.sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens) == 4

    rest_a = tinker.RestClient(base_url=srv.base_url, api_key=KEY_A)
    listed = rest_a.list_user_checkpoints().result(timeout=RESULT_TIMEOUT_S).checkpoints
    assert sorted(c.tinker_path.rsplit("/", 1)[-1] for c in listed) == ["s1", "w1"]

    # A copy is the copier's to keep after the source is gone: it counts against the copier's quota.
    rest_a.publish_checkpoint_from_tinker_path(state).result(timeout=RESULT_TIMEOUT_S)
    rest_b = tinker.RestClient(base_url=srv.base_url, api_key=KEY_B)
    copy = rest_b.copy_weights(state, "team-b").result(timeout=RESULT_TIMEOUT_S)
    assert copy.endswith("/weights/s1")
    start = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="quota"):
        rest_b.copy_weights(state, "team-b").result(timeout=RESULT_TIMEOUT_S)
    assert time.monotonic() - start < 10  # refused at once, not retried
    assert [c.tinker_path for c in rest_b.list_user_checkpoints().result(timeout=RESULT_TIMEOUT_S).checkpoints] \
        == [copy]
