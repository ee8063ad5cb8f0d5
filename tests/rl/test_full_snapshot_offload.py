"""Sampler snapshots of a full fine-tune live in host memory and come to the device one at a time
(``--resident-full-sampler-snapshots 1``): more snapshots than device places, each sampling
exactly the weights it saved, whichever was resident last."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, sft_batch
from tests.e2e.test_metrics import scrape, total
from tests.rl.helpers import full_finetune_client, train_steps_on
from tests.rl.test_full_finetune_sampling import TOKENS, _forward_lp, _sampler_lp

API_KEY = "tml-rl-offload"


@pytest.fixture(scope="module")
def offload_server(make_server):
    return make_server(extra_args=["--max-full-finetunes", "1", "--max-full-sampler-snapshots", "3",
                                   "--resident-full-sampler-snapshots", "1"])


@pytest.mark.e2e
def test_three_snapshots_share_one_device_place_and_each_keeps_its_weights(offload_server, base_model):
    sc = tinker.ServiceClient(base_url=offload_server.base_url, api_key=API_KEY)
    try:
        tc = full_finetune_client(sc, base_model)
        data = sft_batch(seed=6, n_seqs=2, seq_len=10, vocab=VOCAB)
        samplers, expected = [], []
        for i in range(3):
            train_steps_on(tc, data, 1, 2e-2)
            if i == 2:  # a named (stored) one as well
                path = tc.save_weights_for_sampler("offload-named").result(timeout=RESULT_TIMEOUT_S).path
                samplers.append(sc.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S))
            else:
                samplers.append(tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S))
            expected.append(_forward_lp(tc))
        assert not np.allclose(expected[0], expected[1], atol=1e-3)
        train_steps_on(tc, data, 1, 2e-2)  # the live weights move on again
        for order in ([0, 1, 2], [2, 0, 1]):  # each sampled turns the others out of the device
            for i in order:
                np.testing.assert_allclose(_sampler_lp(samplers[i]), expected[i], atol=1e-4)
        # Requests on all three at once: they take turns on the device, none is lost or mixed up.
        futures = [s.compute_logprobs(types.ModelInput.from_ints(TOKENS)) for s in samplers for _ in range(2)]
        for k, f in enumerate(futures):
            lps = f.result(timeout=RESULT_TIMEOUT_S)
            np.testing.assert_allclose(np.asarray(lps[1:], dtype=np.float64), expected[k // 2], atol=1e-4)
        m = scrape(offload_server.base_url)
        host = total(m, "tinsmith_full_sampler_snapshot_bytes", where="host")
        device = total(m, "tinsmith_full_sampler_snapshot_bytes", where="device")
        assert host > 0 and device == pytest.approx(host / 3)  # three held, one resident
    finally:
        sc.close("success").result(timeout=60)
