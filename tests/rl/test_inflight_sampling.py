"""``save_weights_and_get_sampling_client(kind="inflight")``: a sampler that follows the run's
live weights with no copy, for LoRA runs and full fine-tunes (also one sharded over two
data-parallel ranks, whose rank 0 samples a whole copy gathered again after each step), while a
snapshot stays fixed."""

from __future__ import annotations

import numpy as np
import pytest
import tinker

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, lora_client, sft_batch
from tests.e2e.test_metrics import scrape, total
from tests.rl.helpers import full_finetune_client, train_steps_on
from tests.rl.test_full_finetune_sampling import _forward_lp, _sampler_lp

API_KEY = "tml-rl-inflight"


@pytest.fixture(scope="module")
def inflight_server(make_server):
    return make_server(extra_args=["--max-full-finetunes", "2", "--max-full-sampler-snapshots", "2"])


@pytest.fixture(scope="module")
def inflight_group_server(make_server):
    return make_server(extra_args=["--data-parallel-size", "2", "--device", "cpu", "--max-full-sampler-snapshots", "2"])


PROMPT = [int(t) for t in np.random.default_rng(8).integers(4, VOCAB, 40)]  # two prefix-cache blocks and more


def _greedy_matches_whole_prompt(sampler) -> None:
    """A greedy sample's logprobs (its prompt's K/V may come from the prefix cache) equal the
    logprobs of prompt + sample computed whole (prompt-logprob requests never read the cache):
    a cached entry of older weights would break this."""
    params = tinker.types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    seq = sampler.sample(tinker.types.ModelInput.from_ints(PROMPT), 1, params).result(
        timeout=RESULT_TIMEOUT_S).sequences[0]
    whole = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(PROMPT + list(seq.tokens))).result(
        timeout=RESULT_TIMEOUT_S)
    np.testing.assert_allclose(seq.logprobs, whole[len(PROMPT):], atol=1e-4)


def _held_snapshots(srv) -> float:
    return total(scrape(srv.base_url), "tinsmith_sampler_snapshots")


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["lora", "full", "full-dp2"])
def test_inflight_sampler_follows_each_step_and_a_snapshot_does_not(request, base_model, kind):
    inflight_server = request.getfixturevalue("inflight_group_server" if kind == "full-dp2" else "inflight_server")
    sc = tinker.ServiceClient(base_url=inflight_server.base_url, api_key=API_KEY)
    try:
        tc = lora_client(sc, base_model, rank=4, seed=3) if kind == "lora" else full_finetune_client(sc, base_model)
        data = sft_batch(seed=4, n_seqs=2, seq_len=10, vocab=VOCAB)
        train_steps_on(tc, data, 1, 1e-3)
        held = _held_snapshots(inflight_server)
        live = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=RESULT_TIMEOUT_S)
        assert _held_snapshots(inflight_server) == held  # no copy, nothing counted against the key
        fixed = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        assert _held_snapshots(inflight_server) == held + 1
        at_save = _forward_lp(tc)
        np.testing.assert_allclose(_sampler_lp(live), at_save, atol=1e-4)
        _greedy_matches_whole_prompt(live)
        seen = [at_save]
        for _ in range(2):
            train_steps_on(tc, data, 1, 2e-2)  # the step's future has resolved: samples see it
            now = _forward_lp(tc)
            assert not np.allclose(now, seen[-1], atol=1e-3)
            np.testing.assert_allclose(_sampler_lp(live), now, atol=1e-4)
            _greedy_matches_whole_prompt(live)
            np.testing.assert_allclose(_sampler_lp(fixed), at_save, atol=1e-4)
            seen.append(now)
        # a second inflight save returns another session on the same live weights
        again = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=RESULT_TIMEOUT_S)
        np.testing.assert_allclose(_sampler_lp(again), seen[-1], atol=1e-4)
        if kind == "full-dp2":  # rank 0's whole copy: gathered at the first sample and after each step only
            metrics = scrape(inflight_server.base_url)
            assert total(metrics, "tinsmith_inflight_weight_gathers_total") == 3
            assert total(metrics, "tinsmith_inflight_copy_bytes") > 0
    finally:
        sc.close("success").result(timeout=60)


@pytest.mark.e2e
def test_inflight_with_a_path_or_an_unknown_kind_is_refused(inflight_server, base_model):
    import httpx

    sc = tinker.ServiceClient(base_url=inflight_server.base_url, api_key=API_KEY)
    try:
        tc = lora_client(sc, base_model, rank=4, seed=5)
        headers = {"X-API-Key": API_KEY}
        for body, field in (({"path": "x", "kind": "inflight"}, "path"), ({"sampling_session_seq_id": 9,
                                                                           "kind": "frozen"}, "kind")):
            r = httpx.post(inflight_server.base_url + "/api/v1/save_weights_for_sampler",
                           json={"model_id": tc.model_id, "seq_id": 99, **body}, headers=headers, timeout=10)
            assert r.status_code == 400, r.text
            assert field in r.text
    finally:
        sc.close("success").result(timeout=60)
