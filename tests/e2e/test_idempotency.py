"""Replayed submissions (the SDK retries with the same seq_id) map to the original future."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import detail, fb_proto_body, json_result, lora_client, post_fb, raw_client, retrieve, sft_batch

pytestmark = pytest.mark.e2e


def _optim(http, model_id: str, seq_id: int):
    return http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id, "type": "optim_step",
                                                 "adam_params": {"learning_rate": 1e-3}})


def test_duplicate_forward_backward_is_one_request(server, sc, base_model):
    data = sft_batch(seed=8, n_seqs=2, seq_len=12, vocab=VOCAB)
    replayed = str(lora_client(sc, base_model, rank=4, seed=7).model_id)
    single = str(lora_client(sc, base_model, rank=4, seed=7).model_id)

    with raw_client(server.base_url) as http:
        body = fb_proto_body(replayed, 1, data)
        first = post_fb(http, body)
        second = post_fb(http, body)
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        rid = first.json()["request_id"]
        assert isinstance(rid, str) and second.json()["request_id"] == rid
        assert first.json()["model_id"] == replayed

        result = retrieve(http, rid)
        assert result.status_code == 200
        # replays racing each other, and one after completion, still name the same future
        with ThreadPoolExecutor(4) as pool:
            racing = list(pool.map(lambda _: post_fb(http, body).json()["request_id"], range(4)))
        assert racing == [rid] * 4
        assert retrieve(http, rid).content == result.content

        opt = _optim(http, replayed, 2)
        assert _optim(http, replayed, 2).json()["request_id"] == opt.json()["request_id"]
        replayed_metrics = json_result(http, opt.json()["request_id"])["metrics"]

        # the same run submitted once: the gradient was accumulated once, not once per replay
        rid_single = post_fb(http, fb_proto_body(single, 1, data)).json()["request_id"]
        assert rid_single != rid
        assert retrieve(http, rid_single).content == result.content
        single_metrics = json_result(http, _optim(http, single, 2).json()["request_id"])["metrics"]
    assert replayed_metrics["grad_norm"] > 0
    assert replayed_metrics["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)


def test_reused_seq_id_of_another_kind_is_rejected(server, sc, base_model):
    """A sequence number already taken by a different request is an error, never that request's future."""
    tc = lora_client(sc, base_model, rank=4, seed=7)
    model_id = str(tc.model_id)
    data = sft_batch(seed=9, n_seqs=1, seq_len=6, vocab=VOCAB)
    with raw_client(server.base_url) as http:
        # seq_id 0 is the model's creation
        r = post_fb(http, fb_proto_body(model_id, 0, data))
        assert r.status_code == 400, r.text
        assert "seq_id 0" in detail(r) and "create_model" in detail(r)
        fb = post_fb(http, fb_proto_body(model_id, 1, data))
        assert fb.status_code == 200
        r = _optim(http, model_id, 1)
        assert r.status_code == 400, r.text
        assert "seq_id 1" in detail(r) and "forward_backward" in detail(r)
        # a forward is a different request from a forward_backward with the same number
        r = post_fb(http, fb_proto_body(model_id, 1, data, forward_only=True))
        assert r.status_code == 400, r.text
        # the run is intact: its own numbers go on
        assert retrieve(http, fb.json()["request_id"]).status_code == 200
        opt = _optim(http, model_id, 2)
        assert opt.status_code == 200 and json_result(http, opt.json()["request_id"])["metrics"]["grad_norm"] > 0
