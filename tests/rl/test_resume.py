"""Resume training across a server restart from ``save_state`` (weights and AdamW state)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, logprobs_of, lora_client, sft_batch

pytestmark = pytest.mark.e2e

ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.01)


def _step(tc: tinker.TrainingClient, data) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    op = tc.optim_step(ADAM)
    loss = float(fb.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"])
    op.result(timeout=RESULT_TIMEOUT_S)
    return loss


def _fb_loss(tc: tinker.TrainingClient, data) -> float:
    return float(tc.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"])


def test_resume_with_optimizer_across_restart(make_server, base_model):
    srv = make_server()
    batches = [sft_batch(seed=100 + i, n_seqs=3, seq_len=20, vocab=VOCAB) for i in range(6)]

    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-rl-resume")
    tc = lora_client(sc, base_model, rank=8, seed=17)
    for i in range(3):
        _step(tc, batches[i])
    path = tc.save_state("s").result(timeout=RESULT_TIMEOUT_S).path
    assert path == f"tinker://{tc.model_id}/weights/s"
    saved_lps = logprobs_of(tc.forward(batches[3], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    ref4 = _step(tc, batches[3])
    ref5 = _step(tc, batches[4])
    ref6 = _fb_loss(tc, batches[5])

    # SIGTERM, then a new process on the same data dir
    assert srv.stop() is not None
    srv.start()
    sc2 = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-rl-resume")
    try:
        # the old run's unsaved state is gone, and the server says so to its old client
        with pytest.raises(tinker.TinkerError, match="restarted|lost"):
            tc.forward(batches[3], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)

        resumed = sc2.create_training_client_from_state_with_optimizer(path).result(timeout=RESULT_TIMEOUT_S)
        got_lps = logprobs_of(resumed.forward(batches[3], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
        for a, b in zip(got_lps, saved_lps):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        got4 = _step(resumed, batches[3])
        got5 = _step(resumed, batches[4])
        got6 = _fb_loss(resumed, batches[5])
        assert got4 == pytest.approx(ref4, rel=1e-5)
        assert got5 == pytest.approx(ref5, rel=1e-5)
        assert got6 == pytest.approx(ref6, rel=1e-5)

        # weights only: same starting weights, fresh AdamW (so the second step differs)
        fresh = sc2.create_training_client_from_state(path).result(timeout=RESULT_TIMEOUT_S)
        assert fresh.model_id != resumed.model_id
        w4 = _step(fresh, batches[3])
        w5 = _step(fresh, batches[4])
        assert w4 == pytest.approx(ref4, rel=1e-5)
        assert abs(w5 - ref5) > 1e-4 * abs(ref5), (w5, ref5)
        rest = tinker.RestClient(base_url=srv.base_url, api_key="tml-rl-resume")
        info = rest.get_weights_info_by_tinker_path(path).result(timeout=RESULT_TIMEOUT_S)
        assert info.is_lora and info.lora_rank == 8
    finally:
        for client in (sc2, sc):
            try:
                client.close("success").result(timeout=60)
            except Exception:  # noqa: BLE001 - the first session's in-memory state did not survive
                pass


def test_load_missing_checkpoint_names_it(sc, tc_for_missing):
    missing = f"tinker://{tc_for_missing.model_id}/weights/does-not-exist"
    with pytest.raises(tinker.TinkerError) as exc:
        sc.create_training_client_from_state(missing).result(timeout=RESULT_TIMEOUT_S)
    assert "does-not-exist" in str(exc.value)
    if isinstance(exc.value, tinker.APIStatusError):
        assert 400 <= exc.value.status_code < 500
    with pytest.raises(tinker.TinkerError) as exc:
        sc.create_training_client_from_state_with_optimizer("tinker://nope/weights/x").result(
            timeout=RESULT_TIMEOUT_S)
    assert "tinker://nope/weights/x" in str(exc.value)
    # a malformed path is refused too (not a training state)
    with pytest.raises(tinker.TinkerError) as exc:
        sc.create_training_client_from_state(f"tinker://{tc_for_missing.model_id}/sampler_weights/x").result(
            timeout=RESULT_TIMEOUT_S)
    assert "sampler_weights" in str(exc.value)


@pytest.fixture
def tc_for_missing(sc, base_model):
    return lora_client(sc, base_model, rank=4, seed=1)
