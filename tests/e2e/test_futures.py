"""retrieve_futures (the SDK's batched completion poller) and cancel_future, end to end.

The server advertises ``sample_use_retrieve_futures`` and ``sample_cancel_enabled``, so every
SDK 0.38 SamplingClient here polls ``/retrieve_futures``; raw HTTP pins the wire contract, bad
input and what another key may see (nothing).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import KEY_A, KEY_B
from tests.e2e.helpers import RESULT_TIMEOUT_S, detail, raw_client, retrieve
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


def _sampler_session(http, base_model: str) -> str:
    session = http.post("/api/v1/create_session", json={}).json()["session_id"]
    r = http.post("/api/v1/create_sampling_session",
                  json={"session_id": session, "sampling_session_seq_id": 0, "base_model": base_model})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _asample(http, sid: str, seq_id: int, max_tokens: int = 4, num_samples: int = 1) -> str:
    r = http.post("/api/v1/asample", json={
        "sampling_session_id": sid, "seq_id": seq_id, "num_samples": num_samples, "type": "sample",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": max_tokens, "stop": [], "seed": seq_id}})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _outcome(http, request_id: str) -> dict:
    """The final answer of a request: its JSON error, or ``{"result_bytes": n}`` for a (protobuf) result."""
    r = retrieve(http, request_id)
    assert r.status_code == 200, r.text
    if "json" in r.headers["content-type"]:
        return r.json()
    return {"result_bytes": len(r.content)}


def _poll(http, sid: str, cursor: int = 0, clone: int = 0, **kw):
    return http.post("/api/v1/retrieve_futures", json={
        "target": {"type": "sampling_session", "sampling_session_id": sid, "cloned_sampler_id": clone},
        "prev_cursor": cursor, **kw})


def test_flags_are_advertised_and_the_sdk_samples_through_the_poller(sc, base_model):
    client = sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    assert client.holder.get_client_config().sample_use_retrieve_futures is True
    assert client.holder._client_dynamic_config.sample_cancel_enabled is True
    assert client.holder.get_client_config().use_pyqwest_transport is False  # --client-http-transport httpx
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    futures = [client.sample(PROMPT, num_samples=2, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, seed=i)) for i in range(48)]
    results = [f.result(timeout=RESULT_TIMEOUT_S) for f in futures]
    assert client._futures_poller is not None  # the batched path, not one long-poll per sample
    for res in results:
        assert len(res.sequences) == 2
        for seq in res.sequences:
            assert len(seq.tokens) == 6 and len(seq.logprobs) == 6 and np.isfinite(seq.logprobs).all()
    # seeded: the same request answers the same tokens through the poller
    again = client.sample(PROMPT, num_samples=1, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    first = client.sample(PROMPT, num_samples=1, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    assert list(again.sequences[0].tokens) == list(first.sequences[0].tokens)


def test_poller_latency_matches_the_per_future_path(sc, server, base_model):
    """A short sample answers as fast through the poller as through retrieve_future (same server)."""
    client = sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    client.sample(PROMPT, num_samples=1, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)  # warm up

    def timed(fn) -> float:
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    via_poller = timed(lambda: client.sample(PROMPT, num_samples=1, sampling_params=params).result(
        timeout=RESULT_TIMEOUT_S))
    with raw_client(server.base_url) as http:
        sid = _sampler_session(http, base_model)
        n = iter(range(1, 100))
        via_future = timed(lambda: retrieve(http, _asample(http, sid, next(n), max_tokens=1), protobuf=False))
    # The poller wakes on the completion itself (no polling interval): within a few ms of the
    # per-future path, never a long-poll's worth (tens of seconds) or a retry interval (1 s).
    assert via_poller < via_future + 0.25, (via_poller, via_future)


def test_cursor_protocol_over_raw_http(server, base_model):
    with raw_client(server.base_url) as http:
        sid = _sampler_session(http, base_model)
        r = _poll(http, sid, timeout=0)
        assert r.status_code == 200 and r.json() == {"completions": [], "cursor": 0}
        ids = [_asample(http, sid, i) for i in range(1, 4)]
        clone_id = _asample(http, sid, 3 * 1_000_000_000 + 1)
        seen: list[str] = []
        cursor = 0
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(seen) < 3:  # long-polls (no timeout): each answers as soon as something finished
            assert time.monotonic() < deadline
            body = _poll(http, sid, cursor).json()
            assert body["cursor"] >= cursor
            cursor = body["cursor"]
            for c in body["completions"]:
                assert c["state"] == "finished" and c["response_payload_uncompressed_size"] > 0
                seen.append(c["request_id"])
        assert sorted(seen) == sorted(ids)  # clone 0 sees only its own requests
        clone = _poll(http, sid, 0, clone=3).json()
        assert [c["request_id"] for c in clone["completions"]] == [clone_id]
        # acknowledged: nothing new after the cursor; an immediate answer with timeout 0
        t0 = time.monotonic()
        assert _poll(http, sid, clone["cursor"], timeout=0).json()["completions"] == []
        assert time.monotonic() - t0 < 5
        # a short timeout is honoured when nothing finishes
        t0 = time.monotonic()
        assert _poll(http, sid, clone["cursor"], timeout=0.5).json()["completions"] == []
        assert 0.4 < time.monotonic() - t0 < 5
        # results still fetchable, then acknowledged as retrieved: payload dropped
        assert retrieve(http, ids[0], protobuf=False).status_code == 200
        _poll(http, sid, clone["cursor"], timeout=0, retrieved_request_ids=[ids[0]])
        assert retrieve(http, ids[0], protobuf=False).status_code == 410
        assert retrieve(http, ids[1], protobuf=False).status_code == 200


def test_retrieve_futures_bad_and_hostile_input(restricted_server, base_model):
    with raw_client(restricted_server.base_url, KEY_A) as a, raw_client(restricted_server.base_url, KEY_B) as b:
        sid = _sampler_session(a, base_model)
        rid = _asample(a, sid, 1)
        assert retrieve(a, rid, protobuf=False).status_code == 200
        # another key: the sampler does not exist for it, and its acks touch nothing of A's
        r = _poll(b, sid, timeout=0)
        assert r.status_code == 404 and sid in detail(r)
        own = _sampler_session(b, base_model)
        assert _poll(b, own, timeout=0, retrieved_request_ids=[rid]).status_code == 200
        assert retrieve(a, rid, protobuf=False).status_code == 200
        for body, field in [
            ({"target": {"sampling_session_id": sid}, "prev_cursor": -1}, "prev_cursor"),
            ({"target": {"sampling_session_id": sid}, "timeout": -1}, "timeout"),
            ({"target": {"sampling_session_id": sid, "cloned_sampler_id": -1}}, "cloned_sampler_id"),
            ({"target": {"sampling_session_id": sid, "cloned_sampler_id": 1 << 40}}, "cloned_sampler_id"),
            ({"target": {"sampling_session_id": sid, "type": "model"}}, "type"),
            ({"target": {}}, "sampling_session_id"),
            ({"prev_cursor": 0}, "target"),
            ({"target": {"sampling_session_id": sid}, "retrieved_request_ids": [""]}, "retrieved_request_ids"),
        ]:
            r = a.post("/api/v1/retrieve_futures", json=body)
            assert r.status_code == 400, (body, r.text)
            assert field in detail(r), (field, detail(r))
        r = _poll(a, sid, 10**6, timeout=0)  # a cursor this server never handed out
        assert r.status_code == 400 and "prev_cursor" in detail(r)


def test_cancel_stops_a_running_sample_and_frees_the_sampler(server, base_model):
    with raw_client(server.base_url) as http:
        sid = _sampler_session(http, base_model)
        long = _asample(http, sid, 1, max_tokens=500, num_samples=16)
        time.sleep(0.3)  # let it start decoding
        t0 = time.monotonic()
        r = http.post("/api/v1/cancel_future", json={"request_id": long})
        assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
        out = _outcome(http, long)
        assert time.monotonic() - t0 < 5  # dropped at the next decode step, not after 500 tokens
        assert out["category"] == "user" and "cancelled" in out["error"], out
        body = _poll(http, sid, 0, timeout=0).json()
        assert body["completions"] == [{"state": "failed", "request_id": long}]
        # cancelling again, or a finished request, changes nothing
        r = http.post("/api/v1/cancel_future", json={"request_id": long})
        assert r.status_code == 200 and r.json()["cancelled"] is False
        quick = _asample(http, sid, 2)
        assert retrieve(http, quick, protobuf=False).status_code == 200
        r = http.post("/api/v1/cancel_future", json={"request_id": quick})
        assert r.status_code == 200 and r.json() == {"request_id": quick, "cancelled": False, "status": "completed"}


def test_cancel_through_the_sdk_when_a_sample_times_out(sc, server, base_model):
    """An abandoned sample (asyncio timeout) makes the SDK send cancel_future; the server drops it."""
    client = sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    params = types.SamplingParams(max_tokens=500, stop=[])

    async def abandon() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_awaited(client.sample(PROMPT, num_samples=16, sampling_params=params)), 0.5)

    asyncio.run(abandon())
    sid = client._sampling_session_id
    deadline = time.monotonic() + 20
    with Store(Store.default_sqlite_url(server.data_dir)) as store:
        while True:  # the SDK's cancel drain sends cancel_future; the sample fails as cancelled
            reqs = [r for r in store.session_trace(session_id_of_sampler(sid)) if r.sampling_session_id == sid]
            if reqs and reqs[-1].status == "failed":
                break
            assert time.monotonic() < deadline, reqs
            time.sleep(0.1)
        rec = store.get_request(reqs[-1].request_id)
    assert "cancelled" in rec.error and rec.error_category == "user"
    # the poller and the sampler carry on normally afterwards
    res = client.sample(PROMPT, num_samples=1, sampling_params=types.SamplingParams(max_tokens=3)).result(
        timeout=RESULT_TIMEOUT_S)
    assert len(res.sequences[0].tokens) == 3


async def _awaited(future):
    return await future


def session_id_of_sampler(sampling_session_id: str) -> str:
    return sampling_session_id.split(":sample:")[0]


def test_cancel_bad_and_hostile_input(restricted_server, base_model):
    with raw_client(restricted_server.base_url, KEY_A) as a, raw_client(restricted_server.base_url, KEY_B) as b:
        sid = _sampler_session(a, base_model)
        long = _asample(a, sid, 1, max_tokens=300)
        r = b.post("/api/v1/cancel_future", json={"request_id": long})  # another key's future
        assert r.status_code == 404 and long in detail(r)
        assert a.post("/api/v1/cancel_future", json={"request_id": "nope"}).status_code == 404
        for body, field in [({}, "request_id"), ({"request_id": ""}, "request_id"), ({"request_id": 5}, "request_id")]:
            r = a.post("/api/v1/cancel_future", json=body)
            assert r.status_code == 400 and field in detail(r), r.text
        # the other key's attempt changed nothing: A's sample runs to its end
        assert _outcome(a, long)["result_bytes"] > 0
        session = a.post("/api/v1/create_session", json={}).json()["session_id"]
        r = a.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": base_model,
                                                 "lora_config": {"rank": 4}})
        r = a.post("/api/v1/cancel_future", json={"request_id": r.json()["request_id"]})
        assert r.status_code == 400 and "only sampling requests" in detail(r)


def test_the_server_can_hand_the_sdk_pyqwest(make_server, base_model):
    """``--client-http-transport pyqwest``: the SDK sends its requests through pyqwest's transport
    (less client CPU a request; the default, httpx, never aborts a script at exit)."""
    srv = make_server(extra_args=["--client-http-transport", "pyqwest"])
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-e2e-local")
    try:
        client = sc.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
        assert client.holder.get_client_config().use_pyqwest_transport is True
        res = client.sample(PROMPT, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4)
                            ).result(timeout=RESULT_TIMEOUT_S)
        # Each sample runs to max_tokens unless the random model draws its end-of-sequence token.
        assert len(res.sequences) == 2
        assert all(len(s.tokens) == 4 or (s.stop_reason == "stop" and 1 <= len(s.tokens) < 4) for s in res.sequences), \
            [(len(s.tokens), s.stop_reason) for s in res.sequences]
    finally:
        sc.close("success")
