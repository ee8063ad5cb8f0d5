"""A heavy key must not hold the device: other keys' small requests and checkpoint I/O finish
while its huge forward_backward is still running (ordering, not timing, is asserted)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (RESULT_TIMEOUT_S, assert_no_internal_errors, fb_proto_body, fb_result, lora_client,
                               post_fb, raw_client, sft_datum)

pytestmark = pytest.mark.e2e

HEAVY, LIGHT = "tml-fair-heavy", "tml-fair-light"


@pytest.fixture(scope="module")
def fair_server(make_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("fair-keys") / "keys.txt"
    keys.write_text(f"{HEAVY}\n{LIGHT}\n")
    return make_server(api_keys_file=keys)


def test_small_requests_and_saves_do_not_wait_for_another_keys_huge_step(fair_server):
    heavy_sc = tinker.ServiceClient(base_url=fair_server.base_url, api_key=HEAVY)
    light_sc = tinker.ServiceClient(base_url=fair_server.base_url, api_key=LIGHT)
    heavy = lora_client(heavy_sc, fair_server.base_model, rank=4, seed=1)
    light = lora_client(light_sc, fair_server.base_model, rank=4, seed=2)
    rng = np.random.default_rng(0)
    small = [sft_datum(rng.integers(0, VOCAB, 17).tolist())]
    light.forward(small, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)  # warm

    # The heavy key's huge step, sent raw so that it is queued before the light key starts.
    huge = [sft_datum(rng.integers(0, VOCAB, 512).tolist()) for _ in range(128)]
    done: dict[str, float] = {}
    with raw_client(fair_server.base_url, HEAVY) as http:
        r = post_fb(http, fb_proto_body(str(heavy.model_id), 1, huge))
        assert r.status_code == 200, r.text
        heavy_request = r.json()["request_id"]

        def wait_heavy():
            out = fb_result(http, heavy_request)
            done["heavy"] = time.monotonic()
            done["heavy_loss"] = float(out.metrics["loss:sum"])

        waiter = threading.Thread(target=wait_heavy)
        waiter.start()
        light.forward(small, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        done["forward"] = time.monotonic()
        light.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
        light.save_state("mid-heavy").result(timeout=RESULT_TIMEOUT_S)
        done["save"] = time.monotonic()
        waiter.join(timeout=2 * RESULT_TIMEOUT_S)

    assert "heavy" in done, "the huge step never finished"
    assert np.isfinite(done["heavy_loss"]) and done["heavy_loss"] > 0
    assert done["forward"] < done["heavy"], "a small forward waited for another key's whole step"
    assert done["save"] < done["heavy"], "save_state waited for another key's whole step"
    for sc in (heavy_sc, light_sc):
        sc.close("success").result(timeout=60)
    assert_no_internal_errors(fair_server.log_text())
