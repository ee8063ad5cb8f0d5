"""Finished requests' payloads and results are dropped after ``--request-retention-s``; the record
stays, and retrieving such a result answers 410 saying it expired (never a 500, never a 404)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (
    detail,
    fb_proto_body,
    fb_result,
    json_result,
    lora_client,
    post_fb,
    raw_client,
    retrieve,
    sft_batch,
    sft_datum,
)
from tinsmith.store import Store

pytestmark = pytest.mark.e2e


def test_a_purged_result_answers_410(make_server, service_client, base_model):
    srv = make_server(extra_args=["--request-retention-s", "3600"])
    url = Store.default_sqlite_url(srv.data_dir)
    model_id = str(lora_client(service_client(srv), base_model, rank=4, seed=0).model_id)
    data = sft_batch(seed=1, n_seqs=1, seq_len=8, vocab=VOCAB)
    with raw_client(srv.base_url) as http:
        done = post_fb(http, fb_proto_body(model_id, 100, data, forward_only=True)).json()["request_id"]
        fb_result(http, done)
        bad = post_fb(http, fb_proto_body(model_id, 101, [sft_datum([1, VOCAB, 3, 4])])).json()["request_id"]
        failure = json_result(http, bad)
        assert "error" in failure and "model_input" in failure["error"]

        with Store(url) as store:  # what the sweeper does once the retention time has passed
            assert store.purge_request_payloads(datetime.now(UTC)) >= 2
            record = store.get_request(done)
        assert record.is_purged and record.payload == b"" and record.result is None
        assert (record.kind, record.status, record.model_id) == ("forward", "completed", model_id)

        r = retrieve(http, done)
        assert r.status_code == 410, r.text
        assert "expired" in detail(r) and done in detail(r) and "--request-retention-s" in detail(r)
        assert "3600 s" in detail(r)
        assert json_result(http, bad) == failure  # a failure's message is kept with the record
        # a replay of the purged request's seq_id is the same request: the same clear answer
        again = post_fb(http, fb_proto_body(model_id, 100, data, forward_only=True)).json()["request_id"]
        assert again == done and retrieve(http, again).status_code == 410
        r = retrieve(http, "req-never-was")
        assert r.status_code == 404
    assert "Traceback" not in srv.log_text()
