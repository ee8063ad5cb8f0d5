"""Sharded checkpoint writes of a full fine-tune over 2 gloo ranks on CPU: each rank writes the
tensors it owns, rank 0 the index; the checkpoint loads bit-identically in one process and in
the group, a one-process checkpoint loads in the group, the Hugging Face export loads in
transformers as the one written by a single process does, each rank holds about half of the
state while saving, and a rank that cannot write fails the save on both, leaving nothing."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.parallel.fsdp_scenario import build_full_runtime
from tests.parallel.sharded_save_scenario import (assert_bit_identical, failing_rank_main, save_rank_main,
                                                  train_one_step)
from tinsmith.checkpoints.state_format import SHARDED_FORMAT, TrainingState, load_training_state, save_training_state
from tinsmith.parallel.launch import run_ranks
from tinsmith.parallel.sharded_save import owners_by_bytes
from tinsmith.worker.runtime import FULL_UNIT


def test_owners_balance_bytes_deterministically():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10, "f": 10}
    owner = owners_by_bytes(sizes, 2)
    assert owner == owners_by_bytes(dict(reversed(sizes.items())), 2)  # independent of the order given
    load = [sum(n for k, n in sizes.items() if owner[k] == r) for r in range(2)]
    assert sorted(load) == [130, 140]
    assert max(load) <= sum(sizes.values()) / 2 + max(sizes.values())
    assert set(owners_by_bytes({"x": 1}, 3).values()) == {0}


@pytest.mark.parametrize("tied", [False, True], ids=["qwen3", "tied_qwen3"])
def test_sharded_save_loads_everywhere(qwen3_dir, tied_qwen3_dir, tmp_path, tied):
    model_dir = tied_qwen3_dir if tied else qwen3_dir
    one_rt = build_full_runtime(str(model_dir), None)
    train_one_step(one_rt)
    w, o = one_rt.unit(FULL_UNIT).export_state()
    save_training_state(tmp_path / "one", TrainingState("tiny", None, w, o, steps=1))
    out = tmp_path / "out"
    outcomes = run_ranks(save_rank_main, 2, tmp_path / "ranks", (str(model_dir), str(out), str(tmp_path / "one")),
                         timeout_s=30, deadline_s=120)
    for r in outcomes:
        assert r.exitcode == 0, f"rank {r.rank} failed:\n{r.error}"
    res = [r.result for r in outcomes]
    weights, opt = res[0]["gathered"]

    # one logical checkpoint: both ranks' files, listed in the index with their checksums
    meta = json.loads((out / "state" / "meta.json").read_text())
    assert meta["format"] == SHARDED_FORMAT
    for kind in ("weights", "optimizer"):
        assert meta["files"][kind] == [f"{kind}-00001-of-00002.safetensors", f"{kind}-00002-of-00002.safetensors"]
    assert sorted(meta["sha256"]) == sorted(meta["files"]["weights"] + meta["files"]["optimizer"])
    assert res[0]["size"] == sum(f.stat().st_size for f in (out / "state").iterdir()) and res[1]["size"] == 0

    # loads in one process exactly as the group gathers it; and back into the group
    state = load_training_state(out / "state", with_optimizer=True)
    assert state.steps == 1
    assert_bit_identical(weights, state.weights, "weights saved under DP=2, loaded in one process")
    assert_bit_identical(opt, state.optimizer, "optimizer saved under DP=2, loaded in one process")
    for r in res:
        assert_bit_identical(weights, r["reloaded"][0], "saved under DP=2, loaded under DP=2")
        assert_bit_identical(opt, r["reloaded"][1], "saved under DP=2, loaded under DP=2")
        assert_bit_identical(w, r["loaded_one_process"][0], "saved in one process, loaded under DP=2")
        assert_bit_identical(o, r["loaded_one_process"][1], "saved in one process, loaded under DP=2")

    # each rank held its own part of the state only: about half
    total = res[0]["state_bytes"]
    largest = max(t.numel() * t.element_size() for t in [*weights.values(), *opt.values()])
    assert total == sum(t.numel() * t.element_size() for t in [*weights.values(), *opt.values()])
    assert sum(r["state_peak"] for r in res) == total
    assert all(0 < r["state_peak"] <= total / 2 + largest and r["state_peak"] < 0.75 * total for r in res), \
        [r["state_peak"] for r in res]
    assert sum(r["hf_peak"] for r in res) == res[0]["weights_bytes"]

    # the Hugging Face export: two shards and an index, which transformers loads as the one-writer export
    index = json.loads((out / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    assert ("lm_head.weight" in index["weight_map"]) != tied
    sharded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    single = transformers.AutoModelForCausalLM.from_pretrained(out / "hf_one_writer", dtype=torch.float32).state_dict()
    assert_bit_identical(single, sharded, "Hugging Face export")
    assert torch.equal(sharded["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.self_attn.q_proj.weight"])


def test_a_rank_that_cannot_write_fails_the_save_everywhere(qwen3_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    outcomes = run_ranks(failing_rank_main, 2, tmp_path / "ranks", (str(qwen3_dir), str(out)),
                         timeout_s=30, deadline_s=120)
    for r in outcomes:
        assert r.exitcode == 0, f"rank {r.rank} failed:\n{r.error}"
    res = [r.result for r in outcomes]
    for key, what in (("error", "tinker://run/weights/state"), ("hf_error", "tinker://run/weights/hf")):
        kind, message = res[0][key]
        assert kind == "CapacityError" and f"could not write {what} (rank 1)" in message, message
        assert "File too large" in message, message
        assert res[1][key] == res[0][key]  # the same error on every rank: the group stays in step
    assert res[0]["left"] == []  # nothing committed, no temporary left behind
    # the run trained on, and the next save committed what the group holds
    state = load_training_state(out / "state", with_optimizer=True)
    assert_bit_identical(res[0]["after"][0], state.weights, "weights after the failed save")
    assert_bit_identical(res[0]["after"][1], state.optimizer, "optimizer after the failed save")
