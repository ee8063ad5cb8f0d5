"""Checkpoints fail cleanly: name clashes, corrupted files, interrupted saves, storage quota."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (RESULT_TIMEOUT_S, detail, logprobs_of, lora_adapter_bytes, lora_client, raw_client,
                               sft_batch)
from tests.rl.helpers import checkpoint_dir, train_steps_on
from tinsmith.checkpoints import peft_format, state_format
from tinsmith.checkpoints.peft_format import load_peft_adapter, save_peft_adapter
from tinsmith.checkpoints.state_format import TrainingState, load_training_state, save_training_state
from tinsmith.errors import InvalidInputError
from tinsmith.types import LoraSpec

DATA = sft_batch(seed=61, n_seqs=2, seq_len=16, vocab=VOCAB)


def _forward(tc) -> list[np.ndarray]:
    return logprobs_of(tc.forward(DATA, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))


# ------------------------------------------------------------------------------ through the SDK
@pytest.mark.e2e
def test_duplicate_name_fails_then_overwrite_replaces(sc, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=8)
    path = tc.save_state("dup").result(timeout=RESULT_TIMEOUT_S).path
    train_steps_on(tc, DATA, 2, 1e-2)
    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.save_state("dup").result(timeout=RESULT_TIMEOUT_S)
    assert "dup" in str(exc.value) and "overwrite" in str(exc.value)
    # the failed save did not touch the stored checkpoint: it still holds the untrained adapter
    before = sc.create_training_client_from_state(path).result(timeout=RESULT_TIMEOUT_S)
    trained_now = _forward(tc)
    assert max(float(np.abs(a - b).max()) for a, b in zip(_forward(before), trained_now)) > 1e-3

    assert tc.save_state("dup", overwrite=True).result(timeout=RESULT_TIMEOUT_S).path == path
    after = sc.create_training_client_from_state(path).result(timeout=RESULT_TIMEOUT_S)
    for a, b in zip(_forward(after), trained_now):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the run keeps training after the failed save
    assert np.isfinite(train_steps_on(tc, DATA, 1, 1e-2)).all()


@pytest.mark.e2e
def test_duplicate_sampler_and_external_names_fail_the_future(sc, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=9)
    tc.save_weights_for_sampler("dup-s").result(timeout=RESULT_TIMEOUT_S)
    with pytest.raises(tinker.RequestFailedError, match="dup-s"):
        tc.save_weights_for_sampler("dup-s").result(timeout=RESULT_TIMEOUT_S)
    tc.save_weights_external("dup-e").result(timeout=RESULT_TIMEOUT_S)
    with pytest.raises(tinker.RequestFailedError, match="dup-e"):
        tc.save_weights_external("dup-e").result(timeout=RESULT_TIMEOUT_S)


@pytest.mark.e2e
def test_corrupted_weights_file_fails_load_cleanly(sc, base_model, server):
    tc = lora_client(sc, base_model, rank=4, seed=10)
    train_steps_on(tc, DATA, 1, 1e-2)
    path = tc.save_state("corrupt-me").result(timeout=RESULT_TIMEOUT_S).path
    f = checkpoint_dir(server, path) / "weights.safetensors"
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) - 64, len(raw) - 32):  # inside the tensor data, past the header
        raw[i] ^= 0xFF
    f.write_bytes(bytes(raw))
    for create in (sc.create_training_client_from_state, sc.create_training_client_from_state_with_optimizer):
        with pytest.raises(tinker.TinkerError) as exc:
            create(path).result(timeout=RESULT_TIMEOUT_S)
        assert "corrupted" in str(exc.value) and "weights.safetensors" in str(exc.value)
    assert "internal error" not in server.log_text()


@pytest.mark.e2e
def test_corrupted_metadata_is_a_client_error(sc, base_model, server):
    """An unreadable meta.json must give a 4xx naming the problem: a 500 would make the SDK
    retry the load for minutes."""
    tc = lora_client(sc, base_model, rank=4, seed=11)
    path = tc.save_state("bad-meta").result(timeout=RESULT_TIMEOUT_S).path
    meta = checkpoint_dir(server, path) / "meta.json"
    meta.write_text(meta.read_text()[:40])  # truncated JSON
    session_id = str(tc.model_id).split(":train:")[0]
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/load_weights", json={"session_id": session_id, "model_seq_id": 900, "path": path,
                                                     "optimizer": True, "type": "load_weights"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "corrupted" in detail(r)


@pytest.mark.e2e
def test_quota_refuses_the_save_past_it(make_server, base_model, tiny_model):
    # Before any optimizer step a state save holds the weights twice (tensors and their PEFT
    # copy): about 2 adapters' worth, so one fits in 2.5 and a second (or an export) does not.
    adapter = lora_adapter_bytes(tiny_model, rank=4)
    srv = make_server(extra_args=["--checkpoint-quota-bytes", str(int(2.5 * adapter))])
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-rl-quota")
    try:
        tc = lora_client(sc, base_model, rank=4, seed=12)
        first = tc.save_state("q1").result(timeout=RESULT_TIMEOUT_S).path
        with pytest.raises(tinker.RequestFailedError) as exc:
            tc.save_state("q2").result(timeout=RESULT_TIMEOUT_S)
        assert "quota" in str(exc.value)
        with pytest.raises(tinker.RequestFailedError, match="quota"):
            tc.save_weights_external("q3").result(timeout=RESULT_TIMEOUT_S)
        rest = tinker.RestClient(base_url=srv.base_url, api_key="tml-rl-quota")
        assert [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=RESULT_TIMEOUT_S).checkpoints] \
            == [first]
        # freeing space makes saving possible again
        rest.delete_checkpoint_from_tinker_path(first).result(timeout=RESULT_TIMEOUT_S)
        assert tc.save_state("q2").result(timeout=RESULT_TIMEOUT_S).path.endswith("/weights/q2")
    finally:
        sc.close("success").result(timeout=60)


# ------------------------------------------------------------------------------ formats, in-process
def _state(seed: int) -> TrainingState:
    g = torch.Generator().manual_seed(seed)
    w = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
         "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4, generator=g)}
    opt = {f"{k}.{s}": torch.randn_like(v) for k, v in w.items() for s in ("exp_avg", "exp_avg_sq")}
    return TrainingState("base", LoraSpec(rank=4, seed=seed), w, opt, steps=seed)


def _same(a: TrainingState, b: TrainingState) -> bool:
    return a.steps == b.steps and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def _failing_replace(monkeypatch, when):
    real = os.replace

    def replace(src, dst):
        if when(Path(src), Path(dst)):
            raise OSError(28, "No space left on device (simulated)")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_interrupted_first_save_leaves_nothing_loadable(tmp_path, monkeypatch):
    final = tmp_path / "run" / "weights" / "s"
    _failing_replace(monkeypatch, lambda src, dst: dst == final)
    with pytest.raises(OSError):
        save_training_state(final, _state(1))
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # the temporary directory was removed
    with pytest.raises(InvalidInputError, match="no training state"):
        load_training_state(final, with_optimizer=True)


def test_interrupted_overwrite_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    final = tmp_path / "run" / "weights" / "s"
    save_training_state(final, _state(1))
    _failing_replace(monkeypatch, lambda src, dst: dst == final and src.name.startswith(".s.")
                     and "old" not in src.name)
    with pytest.raises(OSError):
        save_training_state(final, _state(2))
    monkeypatch.undo()
    assert _same(load_training_state(final, with_optimizer=True), _state(1))
    assert [p.name for p in final.parent.iterdir()] == ["s"]


def test_leftover_temporary_directory_is_not_a_checkpoint(tmp_path):
    """What a kill -9 between writing and renaming leaves: a hidden temporary directory."""
    final = tmp_path / "run" / "weights" / "s"
    tmp = peft_format.atomic_dir(final)
    (tmp / "weights.safetensors").write_bytes(b"partial")
    with pytest.raises(InvalidInputError, match="no training state"):
        load_training_state(final, with_optimizer=False)
    # a later save under the name works and is what loads
    save_training_state(final, _state(3))
    assert _same(load_training_state(final, with_optimizer=True), _state(3))


def test_kill_between_the_renames_of_an_overwrite_is_undone_at_start_up(tmp_path, monkeypatch):
    """A kill -9 after the old copy is moved aside and before the new one is renamed in."""
    root = tmp_path / "checkpoints"
    final, other = root / "run" / "weights" / "s", root / "run" / "weights" / "t"
    save_training_state(final, _state(1))
    save_training_state(other, _state(4))

    class Killed(BaseException):
        pass

    real = os.replace

    def replace(src, dst):
        if Path(dst) == final:  # the second rename: the process dies here, nothing is put back
            raise Killed()
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # a dead process cleans nothing up
    with pytest.raises(Killed):
        save_training_state(final, _state(2))
    monkeypatch.undo()
    assert not final.exists()
    leftovers = sorted(p.name for p in final.parent.iterdir())
    assert any(".old-" in n for n in leftovers) and len(leftovers) == 3  # old copy, new temp, t
    # a half-written temporary of a save that never reached its renames
    (peft_format.atomic_dir(other) / "weights.safetensors").write_bytes(b"partial")

    assert peft_format.recover_interrupted_commits(root) == (1, 2)
    assert _same(load_training_state(final, with_optimizer=True), _state(1))  # the acknowledged copy
    assert _same(load_training_state(other, with_optimizer=True), _state(4))  # untouched
    assert sorted(p.name for p in final.parent.iterdir()) == ["s", "t"]
    assert peft_format.recover_interrupted_commits(root) == (0, 0)
    assert peft_format.recover_interrupted_commits(tmp_path / "absent") == (0, 0)


def test_state_checksums_and_truncation(tmp_path):
    d = tmp_path / "s"
    save_training_state(d, _state(4))
    opt = d / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-8])
    for with_optimizer in (True, False):  # every file listed in meta.json is checked
        with pytest.raises(InvalidInputError, match="optimizer.safetensors.*corrupted"):
            load_training_state(d, with_optimizer=with_optimizer)
    (d / state_format.META).write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(InvalidInputError, match="something-else/9"):
        load_training_state(d, with_optimizer=False)
    (d / state_format.META).write_text("{not json")
    with pytest.raises(InvalidInputError, match="corrupted"):
        load_training_state(d, with_optimizer=False)


def test_a_stored_state_reads_tensors_when_asked(tmp_path):
    """Left in its files, a state reads the same tensors (whole, or some rows alone), knows their
    shapes without reading them, travels pickled as its paths, and a file gone since it was
    opened is a 400 naming it."""
    import pickle

    from tinsmith.checkpoints.stored_tensors import StoredTensors, rows_of, shape_of

    d = tmp_path / "s"
    st = _state(6)
    save_training_state(d, st)
    stored = load_training_state(d, with_optimizer=True, stored=True)
    assert isinstance(stored.weights, StoredTensors) and isinstance(stored.optimizer, StoredTensors)
    assert _same(stored, st) and set(stored.optimizer) == set(st.optimizer)
    name = "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert shape_of(stored.weights, name) == (16, 4) and shape_of(stored.weights, "absent") is None
    assert torch.equal(rows_of(stored.weights, name, 3, 7), st.weights[name][3:7])
    travelled = pickle.loads(pickle.dumps(stored.optimizer))
    assert all(torch.equal(travelled[k], st.optimizer[k]) for k in st.optimizer)
    (d / "optimizer.safetensors").unlink()
    with pytest.raises(InvalidInputError, match="optimizer.safetensors.*could not be read"):
        travelled[f"{name}.exp_avg"]


def test_peft_adapter_checksum(tmp_path):
    d = tmp_path / "adapter"
    st = _state(5)
    save_peft_adapter(d, st.lora, st.weights, "base")
    spec, tensors = load_peft_adapter(d)
    assert spec.rank == 4 and all(torch.equal(tensors[k], st.weights[k]) for k in st.weights)
    w = d / peft_format.WEIGHTS
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 0x01
    w.write_bytes(bytes(raw))
    with pytest.raises(InvalidInputError, match="corrupted"):
        load_peft_adapter(d)


def test_recovery_tells_old_copies_from_temporaries_of_names_that_contain_old(tmp_path):
    """A checkpoint may be called ``x.old-3``: its unfinished temporary is not an old copy of ``x``."""
    parent = tmp_path / "run" / "weights"
    tmp = peft_format.atomic_dir(parent / "x.old-3")  # .x.old-3.XXXXXXXX, never committed
    (tmp / "weights.safetensors").write_bytes(b"partial")
    save_training_state(parent / "y.old-7", _state(5))
    os.replace(parent / "y.old-7", parent / ".y.old-7.old-4242")  # killed between the renames
    assert peft_format.recover_interrupted_commits(tmp_path) == (1, 1)
    assert sorted(p.name for p in parent.iterdir()) == ["y.old-7"]
    assert _same(load_training_state(parent / "y.old-7", with_optimizer=True), _state(5))


def test_server_start_up_restores_an_interrupted_overwrite(tmp_path):
    """The recovery above runs when the server starts (before it takes requests)."""
    from tinsmith.server.config import ServerConfig
    from tinsmith.server.state import ServerState

    config = ServerConfig(base_model=["unused"], data_dir=str(tmp_path))
    final = config.resolved_checkpoint_dir / "run" / "weights" / "s"
    save_training_state(final, _state(1))
    os.replace(final, final.with_name(".s.old-4242"))  # as a kill between the renames leaves it
    state = ServerState.build(config)
    try:
        state.store.migrate()  # as start() does first
        state.recover_after_restart()
    finally:
        state.store.close()
    assert _same(load_training_state(final, with_optimizer=True), _state(1))


def test_a_stored_state_that_cannot_be_read_changes_nothing(qwen3_dir, tmp_path):
    """One process reads every tensor of a stored checkpoint before replacing any: an optimizer
    file gone after the checkpoint was opened is a 400, and the run keeps its weights."""
    from tinsmith.models.loading import load_model
    from tinsmith.worker.runtime import TrainingRuntime

    rt = TrainingRuntime(load_model(str(qwen3_dir)).model)
    unit = rt.unit(rt.create_adapter(LoraSpec(rank=2, seed=1)))
    weights, _ = unit.export_state()
    saved = {k: v + 1.0 for k, v in weights.items()}
    opt = {f"{k}.{s}": torch.ones_like(v) for k, v in weights.items() for s in ("exp_avg", "exp_avg_sq")}
    opt.update({f"{k}.step": torch.ones(1) for k in weights})
    save_training_state(tmp_path / "s", TrainingState("base", LoraSpec(rank=2, seed=1), saved, opt, steps=1))
    stored = load_training_state(tmp_path / "s", with_optimizer=True, stored=True)
    (tmp_path / "s" / "optimizer.safetensors").unlink()
    with pytest.raises(InvalidInputError, match="optimizer.safetensors.*could not be read"):
        unit.import_state(stored.weights, stored.optimizer)
    after, _ = unit.export_state()
    assert all(torch.equal(after[k], weights[k]) for k in weights)
