"""Dimuon through the real SDK: create, train, save and resume, isolation, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (RESULT_TIMEOUT_S, detail, logprobs_of, loss_sum, lora_client, raw_client,
                               repeated_pattern_batch, sft_batch)

pytestmark = pytest.mark.e2e

DIMUON = types.DimuonParams(learning_rate=0.05, beta1=0.9, grad_clip_norm=5.0)


def _step(tc: tinker.TrainingClient, data, params=DIMUON) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    op = tc.optim_step(params)
    loss = loss_sum(fb.result(timeout=RESULT_TIMEOUT_S))
    op.result(timeout=RESULT_TIMEOUT_S)
    return loss


def _dimuon_client(sc: tinker.ServiceClient, base_model: str, rank: int = 4, seed: int = 0) -> tinker.TrainingClient:
    return sc.create_lora_training_client(base_model=base_model, rank=rank, seed=seed,
                                          optimizer=types.DimuonOptimizerConfig()).result(timeout=RESULT_TIMEOUT_S)


def _forward(tc: tinker.TrainingClient, data) -> list[np.ndarray]:
    return logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))


def test_dimuon_trains_resumes_identically_and_leaves_adamw_tenant_alone(server, service_client, base_model):
    sc = service_client()
    other = service_client(api_key="tml-e2e-dimuon-neighbour")
    # Another tenant's AdamW adapter, with optimizer state and pending gradients of its own.
    adam = lora_client(other, base_model, rank=4, seed=5)
    probe = sft_batch(seed=5, n_seqs=2, seq_len=12, vocab=VOCAB)
    _step(adam, probe, types.AdamParams(learning_rate=1e-2))
    adam_before = _forward(adam, probe)

    tc = _dimuon_client(sc, base_model)
    assert tc.get_info().optimizer_config.model_dump() == {"type": "dimuon", "version": 1}
    data = repeated_pattern_batch(seed=3, n_seqs=3, seq_len=24, vocab=VOCAB)
    losses = [_step(tc, data) for _ in range(6)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.6 * losses[0], losses

    path = tc.save_state("dimuon-mid").result(timeout=RESULT_TIMEOUT_S).path
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-e2e-local")
    info = rest.get_weights_info_by_tinker_path(path).result(timeout=RESULT_TIMEOUT_S)
    assert info.optimizer_config.model_dump() == {"type": "dimuon", "version": 1}
    batches = [sft_batch(seed=40 + i, n_seqs=2, seq_len=16, vocab=VOCAB) for i in range(3)]
    ref = [_step(tc, b) for b in batches]
    ref_lps = _forward(tc, data)

    resumed = sc.create_training_client_from_state_with_optimizer(path).result(timeout=RESULT_TIMEOUT_S)
    assert resumed.get_info().optimizer_config.model_dump() == {"type": "dimuon", "version": 1}
    got = [_step(resumed, b) for b in batches]
    assert got == ref  # bit-identical: same weights, same momentum, same arithmetic
    for a, b in zip(_forward(resumed, data), ref_lps):
        assert np.array_equal(a, b)

    # Weights only: the new run takes the optimizer the client asks for (AdamW by default).
    plain = sc.create_training_client_from_state(path).result(timeout=RESULT_TIMEOUT_S)
    assert plain.get_info().optimizer_config.type == "adamw"
    _step(plain, data, types.AdamParams(learning_rate=1e-3))
    again = sc.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig()).result(
        timeout=RESULT_TIMEOUT_S)
    assert again.get_info().optimizer_config.type == "dimuon"
    _step(again, data)

    for a, b in zip(_forward(adam, probe), adam_before):
        assert np.array_equal(a, b)


def test_dimuon_bad_input_is_400_naming_the_field(server, sc, base_model):
    dim = _dimuon_client(sc, base_model, seed=1)
    adam = lora_client(sc, base_model, rank=4, seed=2)
    session_id = str(dim.model_id).split(":train:")[0]
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/create_model", json={
            "session_id": session_id, "model_seq_id": 900, "base_model": base_model,
            "lora_config": {"rank": 4}, "optimizer_config": {"type": "lion"}})
        assert r.status_code == 400 and "'lion'" in detail(r) and "adamw, dimuon" in detail(r), detail(r)
        r = http.post("/api/v1/create_model", json={
            "session_id": session_id, "model_seq_id": 901, "base_model": base_model,
            "lora_config": {"rank": 4}, "optimizer_config": {"type": "dimuon", "version": 7}})
        assert r.status_code == 400 and "optimizer_config.version" in detail(r), detail(r)

        def optim(model_id, **params):
            return http.post("/api/v1/optim_step", json={"model_id": str(model_id), "seq_id": 10_000, **params})

        r = optim(dim.model_id, adam_params=types.AdamParams(learning_rate=1e-3).model_dump())
        assert r.status_code == 400 and "adam_params" in detail(r) and "dimuon" in detail(r), detail(r)
        r = optim(adam.model_id, optimizer_params={"type": "dimuon", "learning_rate": 1e-3})
        assert r.status_code == 400 and "optimizer_params" in detail(r) and "adamw" in detail(r), detail(r)
        r = optim(dim.model_id, optimizer_params={"type": "dimuon", "learning_rate": -1e-3})
        assert r.status_code == 400 and "optimizer_params.learning_rate" in detail(r), detail(r)
        r = optim(dim.model_id, optimizer_params={"type": "dimuon", "learning_rate": 1e-3, "damping": 0.0})
        assert r.status_code == 400 and "optimizer_params.damping" in detail(r), detail(r)
        r = optim(dim.model_id, optimizer_params={"type": "dimuon", "learning_rate": 1e-3, "weight_decay": 0.1})
        assert r.status_code == 400 and "optimizer_params.weight_decay" in detail(r), detail(r)
        r = optim(dim.model_id, optimizer_params={"type": "dimuon"})
        assert r.status_code == 400 and "learning_rate" in detail(r), detail(r)
        r = optim(dim.model_id, optimizer_params={"type": "lion", "learning_rate": 1e-3})
        assert r.status_code == 400 and "'lion'" in detail(r) and "adamw, dimuon" in detail(r), detail(r)

    # The SDK refuses a negative learning rate itself; a Dimuon checkpoint's optimizer state
    # cannot go into an AdamW run.
    with pytest.raises(ValueError):
        types.DimuonParams(learning_rate=-1.0)
    data = sft_batch(seed=8, n_seqs=1, seq_len=8, vocab=VOCAB)
    _step(dim, data)
    path = dim.save_state("dimuon-bad").result(timeout=RESULT_TIMEOUT_S).path
    with pytest.raises(tinker.BadRequestError) as exc, pytest.warns(FutureWarning):  # the legacy load is deprecated
        adam.load_state_with_optimizer(path).result(timeout=RESULT_TIMEOUT_S)
    assert "dimuon" in str(exc.value) and "adamw" in str(exc.value)
    # Both runs still train.
    _step(dim, data)
    _step(adam, data, types.AdamParams(learning_rate=1e-3))
