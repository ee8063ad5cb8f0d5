"""The SPMD executor: rank 0 broadcasts each call, every rank runs it on its shards, and the
driver's results equal one process's; errors every rank raises alike keep the group going, an
error on one rank only fails every rank."""

from __future__ import annotations

import torch

from tests.parallel.scenario import assert_same, build_runtime, spmd_calls, spmd_main
from tinsmith.parallel.launch import run_ranks


def test_driver_runs_every_rank_and_matches_one_process(qwen3_dir, tmp_path):
    rt = build_runtime(str(qwen3_dir), None)
    # One process's state is full-size already: its unit's own export/import stand for the full-size calls.
    plain = {"export_full_state": lambda u: rt.unit(u).export_state(),
             "import_full_state": lambda u, w, o: rt.unit(u).import_state(w, o)}
    ref = spmd_calls(lambda method, *a, **k: (plain[method] if method in plain else getattr(rt, method))(*a, **k), rt.config.vocab_size)
    outcomes = run_ranks(spmd_main, 2, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=90)
    driver, follower = outcomes
    assert driver.exitcode == 0, driver.error
    got = driver.result
    assert got.pop("divergent").startswith("ParallelError: ranks disagree after fail_on_rank")
    assert ref["refused"] == got["refused"] == "InvalidInputError"
    assert ref["missing_unit"] == got["missing_unit"] == "NotFoundError"
    assert_same(ref, got)
    # The follower ran every call (create, export, import, forward/backward, step, export, the
    # refused lookup, the divergent call) and then left with the group's error.
    assert follower.exitcode != 0 and "ranks disagree after fail_on_rank" in follower.error
    assert torch.is_tensor(got["after"][0]["model.layers.0.self_attn.q_proj.lora_B.weight"])
