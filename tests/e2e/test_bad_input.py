"""Bad input through the SDK and raw HTTP: a clear 4xx or a failed future naming the problem.

After every case another tenant's run on the same server must still work and be unchanged, and
the server must never have answered with an internal error (checked in its log).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import BODY_LIMIT, KEY_A, MAX_LORA_RANK, VOCAB
from tests.e2e.helpers import (
    PROTOBUF,
    RESULT_TIMEOUT_S,
    assert_no_internal_errors,
    detail,
    fb_proto_body,
    logprobs_of,
    lora_client,
    loss_sum,
    post_fb,
    raw_client,
    sft_batch,
    sft_datum,
)

pytestmark = pytest.mark.e2e



class Bystander:
    """Another tenant's run: its forward must stay what it was, and its training must keep working."""

    def __init__(self, base_url: str, base_model: str):
        self.sc = tinker.ServiceClient(base_url=base_url, api_key="tml-e2e-bystander")
        self.tc = lora_client(self.sc, base_model, rank=4, seed=99)
        self.data = sft_batch(seed=99, n_seqs=2, seq_len=16, vocab=VOCAB)
        self.baseline = logprobs_of(self.tc.forward(self.data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))

    def check(self) -> None:
        now = logprobs_of(self.tc.forward(self.data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
        for a, b in zip(now, self.baseline):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        # training still works (gradients only accumulate; no optim_step, so forward stays fixed)
        fb = self.tc.forward_backward(self.data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        assert loss_sum(fb) == pytest.approx(-sum(float(x.sum()) for x in self.baseline), rel=1e-5)


@pytest.fixture(scope="module")
def bystander(server, base_model):
    b = Bystander(server.base_url, base_model)
    yield b
    b.sc.close("success").result(timeout=60)


@pytest.fixture(autouse=True)
def _still_healthy(server, bystander):
    """After each case: the other tenant is unaffected and the server logged no internal error."""
    before = len(server.log_text())
    yield
    bystander.check()
    assert_no_internal_errors(server.log_text()[before:])


@pytest.fixture
def tc(sc, base_model):
    return lora_client(sc, base_model, rank=4, seed=0)


def _datum(tokens, targets, weights=None):
    inputs = {"target_tokens": targets}
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


# ------------------------------------------------------------------------------------- raw HTTP
def test_malformed_protobuf_body(server, tc):
    with raw_client(server.base_url) as http:
        r = post_fb(http, b"\xff\xff\xff\xff not a protobuf message")
        assert r.status_code == 400
        assert "ForwardBackwardRequest" in detail(r)

        # a valid message with no model id, and one with no data
        r = post_fb(http, fb_proto_body("", 1, sft_batch(0, 1, 4, VOCAB)))
        assert r.status_code == 400 and "model_id" in detail(r)
        body = fb_proto_body(str(tc.model_id), 1, sft_batch(0, 1, 4, VOCAB))
        from tinker.proto import tinker_public_pb2 as pb

        msg = pb.ForwardBackwardRequest.FromString(body)
        del msg.data[:]
        r = post_fb(http, msg.SerializeToString())
        assert r.status_code == 400 and "data is empty" in detail(r)

        # zstd-declared garbage
        r = http.post("/api/v1/forward_backward", content=b"garbage",
                      headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"})
        assert r.status_code == 400 and "zstd" in detail(r)
    # the client whose model id was used keeps working
    out = tc.forward(sft_batch(1, 1, 8, VOCAB), "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert logprobs_of(out)[0].shape == (8,)


def test_malformed_json_bodies(server, tc):
    with raw_client(server.base_url) as http:
        json_headers = {"Content-Type": "application/json"}
        for path in ("/api/v1/optim_step", "/api/v1/create_session", "/api/v1/get_info", "/api/v1/retrieve_future"):
            r = http.post(path, content=b'{"model_id": ', headers=json_headers)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert "invalid request" in detail(r), path
        r = http.post("/api/v1/forward_backward", content=b"{nope", headers=json_headers)
        assert r.status_code == 400 and "not valid JSON" in detail(r)
        # well-formed JSON of the wrong shape
        r = http.post("/api/v1/optim_step", json={"model_id": str(tc.model_id), "seq_id": 1,
                                                  "adam_params": {"learning_rate": "fast"}})
        assert r.status_code == 400 and "learning_rate" in detail(r)
        r = http.post("/api/v1/create_model", json={"session_id": 5})
        assert r.status_code == 400 and "session_id" in detail(r)
        # a route reading its optional body itself: same 400 (and the connection stays usable)
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        for bad in (b"{nope", b'{"reason": {"type": "bored"}}', b"[1, 2]"):
            r = http.post(f"/api/v1/sessions/{sid}/finish", content=bad, headers=json_headers)
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert "invalid request" in detail(r)
        r = http.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}, "detail": None})
        assert r.status_code == 200
        r = http.post("/api/v1/session_heartbeat", json={"session_id": sid})
        assert r.status_code == 410


def test_unknown_model_id(server):
    missing = "00000000-0000-0000-0000-000000000000:train:0"
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-e2e-local")
    with pytest.raises(tinker.NotFoundError) as exc:
        rest.get_training_run(missing).result(timeout=RESULT_TIMEOUT_S)
    assert missing in str(exc.value)
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/get_info", json={"model_id": missing, "type": "get_info"})
        assert r.status_code == 404 and missing in detail(r)
        r = post_fb(http, fb_proto_body(missing, 1, sft_batch(0, 1, 4, VOCAB)))
        assert r.status_code == 404 and missing in detail(r)
        r = http.post("/api/v1/optim_step", json={"model_id": missing, "seq_id": 2, "type": "optim_step",
                                                  "adam_params": {"learning_rate": 1e-3}})
        assert r.status_code == 404 and missing in detail(r)
        r = http.post("/api/v1/create_model", json={"session_id": "no-such-session", "model_seq_id": 0,
                                                    "base_model": "x", "lora_config": {"rank": 4}})
        assert r.status_code == 404 and "no-such-session" in detail(r)


def test_retrieve_unknown_future(server):
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/retrieve_future", json={"request_id": "req-does-not-exist",
                                                       "allow_metadata_only": True})
        assert r.status_code == 404
        assert "req-does-not-exist" in detail(r)


# ------------------------------------------------------------------------------------- SDK
def test_unknown_loss_name(tc):
    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum([1, 2, 3], [2, 3, 4])], "no_such_loss").result(timeout=RESULT_TIMEOUT_S)
    msg = str(exc.value)
    assert "no_such_loss" in msg and "cross_entropy" in msg  # names the loss and what is supported
    assert exc.value.category == "user"
    # the run is still usable afterwards
    assert loss_sum(tc.forward_backward([_datum([1, 2, 3], [2, 3, 4])], "cross_entropy")
                    .result(timeout=RESULT_TIMEOUT_S)) > 0


def test_target_shape_mismatch(tc):
    # targets shorter than the input: rejected when submitted
    with pytest.raises(tinker.BadRequestError) as exc:
        tc.forward_backward([_datum([1, 2, 3], [2, 3])], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert "target_tokens" in str(exc.value) and "3 tokens" in str(exc.value)
    # weights shaped (N, 2) next to (N,) targets: rejected by the loss validation
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4],
                        "weights": types.TensorData.from_numpy(np.ones((3, 2), dtype=np.float32))},
    )
    with pytest.raises(tinker.RequestFailedError) as exc2:
        tc.forward_backward([bad], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert "weights" in str(exc2.value) and "(3, 2)" in str(exc2.value)
    assert exc2.value.category == "user"
    out = tc.forward([_datum([1, 2, 3], [2, 3, 4])], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert logprobs_of(out)[0].shape == (3,)


@pytest.mark.parametrize("where", ["model_input", "target_tokens"])
def test_token_id_out_of_vocab(tc, where):
    tokens, targets = [1, 2, 3], [2, 3, 4]
    if where == "model_input":
        tokens = [1, VOCAB, 3]
    else:
        targets = [2, 3, VOCAB + 7]
    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum(tokens, targets)], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    msg = str(exc.value)
    assert where in msg and f"[0, {VOCAB})" in msg
    assert exc.value.category == "user"


def test_batch_with_one_bad_datum_changes_nothing(tc):
    """A rejected request leaves no gradient behind: the next step equals one without it."""
    good = sft_batch(seed=5, n_seqs=2, seq_len=10, vocab=VOCAB)
    before = loss_sum(tc.forward(good, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    with pytest.raises(tinker.RequestFailedError):
        tc.forward_backward(good + [_datum([1, 2, VOCAB], [2, 3, 4])], "cross_entropy").result(
            timeout=RESULT_TIMEOUT_S)
    after = loss_sum(tc.forward(good, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    assert after == before


def test_rank_above_server_limit(sc, base_model):
    with pytest.raises(tinker.BadRequestError) as exc:
        sc.create_lora_training_client(base_model=base_model, rank=MAX_LORA_RANK * 2).result(
            timeout=RESULT_TIMEOUT_S)
    msg = str(exc.value)
    assert f"rank={MAX_LORA_RANK * 2}" in msg and "--max-lora-rank" in msg and str(MAX_LORA_RANK) in msg
    # the largest allowed rank works, in the same session
    tc = lora_client(sc, base_model, rank=MAX_LORA_RANK, seed=0)
    assert tc.get_info().lora_rank == MAX_LORA_RANK


def test_unknown_base_model(sc, base_model):
    with pytest.raises(tinker.BadRequestError) as exc:
        sc.create_lora_training_client(base_model="Qwen/not-served", rank=4).result(timeout=RESULT_TIMEOUT_S)
    assert "Qwen/not-served" in str(exc.value) and base_model in str(exc.value)


def test_oversized_body_is_413(restricted_server, service_client, base_model):
    limit, small = BODY_LIMIT, restricted_server
    tc = lora_client(service_client(small, KEY_A), base_model, rank=4, seed=0)
    big = sft_batch(seed=1, n_seqs=8, seq_len=400, vocab=VOCAB)  # ~8 x 400 x (4 + 8 + 4) bytes
    with raw_client(small.base_url, KEY_A) as http:
        body = fb_proto_body(str(tc.model_id), 1, big)
        assert len(body) > limit
        r = post_fb(http, body)
        assert r.status_code == 413
        assert str(limit) in detail(r)
        # the same body streamed without a Content-Length is cut off too
        r = http.post("/api/v1/forward_backward", content=iter([body[:4096], body[4096:]]),
                      headers={"Content-Type": PROTOBUF})
        assert r.status_code == 413 and str(limit) in detail(r)
        # the limit holds on the JSON routes too, declared or streamed, before authentication
        big_json = json.dumps({"tags": ["x" * (2 * limit)], "sdk_version": "0.38.0"}).encode()
        r = http.post("/api/v1/create_session", content=big_json, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and str(limit) in detail(r)
        r = http.post("/api/v1/telemetry", content=iter([big_json[:100], big_json[100:]]),
                      headers={"Content-Type": "application/json", "X-API-Key": "not-a-key"})
        assert r.status_code == 413 and str(limit) in detail(r)
        # bodies under the limit, declared or streamed, are untouched
        small_json = json.dumps({"tags": ["y" * 100], "sdk_version": "0.38.0"}).encode()
        r = http.post("/api/v1/create_session", content=iter([small_json[:10], small_json[10:]]),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["session_id"]
    with pytest.raises(tinker.APIStatusError) as exc:
        tc.forward_backward(big, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert exc.value.status_code == 413
    # small requests still work on that server
    out = tc.forward_backward([sft_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert logprobs_of(out)[0].shape == (3,)
    assert "Traceback" not in small.log_text()


def test_sdk_splits_its_calls_within_the_server_limits(make_server, server, service_client, base_model):
    """Lowered forward limits reach the SDK through client/config: it splits its calls and never
    sees them refused; what it cannot split (one long datum, num_samples) is refused naming the option."""
    small = make_server(extra_args=["--max-forward-datums", "3", "--max-forward-tokens", "40",
                                    "--max-num-samples", "2"])
    data = sft_batch(seed=7, n_seqs=7, seq_len=10, vocab=VOCAB)
    here = lora_client(service_client(small), base_model, rank=4, seed=3)
    there = lora_client(service_client(server), base_model, rank=4, seed=3)
    split = here.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    whole = there.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    for a, b in zip(logprobs_of(split), logprobs_of(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(tinker.BadRequestError) as exc:
        here.forward([sft_datum(list(range(1, 43)))], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    assert "--max-forward-tokens" in str(exc.value) and "40" in str(exc.value)
    sampler = service_client(small).create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    with pytest.raises(tinker.BadRequestError) as exc:
        sampler.sample(prompt, 3, types.SamplingParams(max_tokens=2)).result(timeout=RESULT_TIMEOUT_S)
    assert "num_samples" in str(exc.value) and "--max-num-samples" in str(exc.value)
    assert len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2)).result(
        timeout=RESULT_TIMEOUT_S).sequences) == 2
    assert_no_internal_errors(small.log_text())
