"""Sampling from a full fine-tune: ``save_weights_and_get_sampling_client`` and named
``save_weights_for_sampler`` freeze a copy of the whole model that later training never reaches."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, logprobs_of, sft_batch, sft_datum
from tests.rl.helpers import full_finetune_client, train_steps_on

API_KEY = "tml-rl-full-sampling"
TOKENS = [5, 17, 99, 3, 250, 41, 8, 77, 12]


@pytest.fixture(scope="module")
def full_server(make_server):
    return make_server(extra_args=["--max-full-finetunes", "2", "--max-full-sampler-snapshots", "1"])


@pytest.fixture
def trained(full_server, base_model):
    sc = tinker.ServiceClient(base_url=full_server.base_url, api_key=API_KEY)
    tc = full_finetune_client(sc, base_model)
    data = sft_batch(seed=2, n_seqs=2, seq_len=10, vocab=VOCAB)
    train_steps_on(tc, data, 2, 1e-3)
    yield tc, data
    sc.close("success").result(timeout=60)


def _forward_lp(tc) -> np.ndarray:
    return logprobs_of(tc.forward([sft_datum(TOKENS)], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]


def _sampler_lp(sampler) -> np.ndarray:
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result(timeout=RESULT_TIMEOUT_S)
    assert lps[0] is None
    return np.asarray(lps[1:], dtype=np.float64)


@pytest.mark.e2e
def test_snapshot_samples_the_weights_saved_and_ignores_later_steps(trained, full_server, base_model):
    tc, data = trained
    other = tinker.ServiceClient(base_url=full_server.base_url, api_key="tml-rl-full-sampling-neighbour")
    base_sampler = other.create_sampling_client(base_model=base_model).result(timeout=RESULT_TIMEOUT_S)
    base_before = _sampler_lp(base_sampler)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    at_save = _forward_lp(tc)
    np.testing.assert_allclose(_sampler_lp(sampler), at_save, atol=1e-4)
    out = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)).result(
        timeout=RESULT_TIMEOUT_S)
    assert len(out.sequences) == 2 and all(len(s.tokens) == 5 for s in out.sequences)

    train_steps_on(tc, data, 2, 1e-2)
    after = _forward_lp(tc)
    assert not np.allclose(after, at_save, atol=1e-3)  # training went on
    np.testing.assert_allclose(_sampler_lp(sampler), at_save, atol=1e-4)  # the snapshot did not
    np.testing.assert_array_equal(_sampler_lp(base_sampler), base_before)  # nor did the shared base model
    other.close("success").result(timeout=60)


@pytest.mark.e2e
def test_named_full_snapshot_reloads_from_disk_after_eviction(trained, full_server):
    tc, data = trained
    path = tc.save_weights_for_sampler("full-s").result(timeout=RESULT_TIMEOUT_S).path
    at_save = _forward_lp(tc)
    sc = tinker.ServiceClient(base_url=full_server.base_url, api_key=API_KEY)
    try:
        named = sc.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S)
        np.testing.assert_allclose(_sampler_lp(named), at_save, atol=1e-4)
        train_steps_on(tc, data, 1, 1e-2)
        # --max-full-sampler-snapshots 1: this one evicts the stored snapshot from memory ...
        ephemeral = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        np.testing.assert_allclose(_sampler_lp(ephemeral), _forward_lp(tc), atol=1e-4)
        # ... which comes back from disk unchanged (and in turn evicts the in-memory one).
        np.testing.assert_allclose(_sampler_lp(named), at_save, atol=1e-4)
        with pytest.raises(tinker.TinkerError, match="no longer held"):
            _sampler_lp(ephemeral)
    finally:
        sc.close("success").result(timeout=60)
