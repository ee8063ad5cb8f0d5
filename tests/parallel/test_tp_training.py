"""Tensor parallelism over 2 gloo ranks on CPU gives what one process gives, within 1e-5:
logprobs, loss, LoRA gradients (gathered to full size), one clipped AdamW step (weights and
optimizer state), logprobs after it, and greedy decoding with and without an adapter; Dimuon's
steps too."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.scenario import (assert_same, build_runtime, dimuon_rank_main, dimuon_scenario,
                                    joint_steps_rank_main, load_and_score, rank_main, run_scenario)
from tinsmith.parallel.launch import run_ranks

@pytest.mark.parametrize("families", [("qwen3", "tied_qwen3"), ("llama", "qwen2"), ("qwen3_moe", "gpt_oss"),
                                      ("qwen3_5", "qwen3_5_moe")])
def test_two_ranks_match_one_process(request, model_dirs, tmp_path, families):
    """Also: a checkpoint saved by one process loads under TP=2, and one saved (gathered) under
    TP=2 loads in one process, with the same state and logprobs. Two families per group of ranks;
    the mixture-of-experts models run their experts split over the ranks (expert parallel), and
    gpt-oss keeps each query head's attention sink with its head."""
    dirs = [str(model_dirs[f] if f in model_dirs else request.getfixturevalue(f"{f}_dir")) for f in families]
    refs, cases = [], []
    for i, d in enumerate(dirs):
        one, two = tmp_path / f"tp1-{i}", tmp_path / f"tp2-{i}"
        refs.append(run_scenario(build_runtime(d, None), sharded=False, save_to=str(one), load_from=str(one)))
        cases.append((d, str(two), str(one)))
    outcomes = run_ranks(rank_main, 2, tmp_path / "ranks", (cases,), timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    for (d, two, _), ref, got0, got1 in zip(cases, refs, outcomes[0].result, outcomes[1].result):
        assert ref["step"][0]["grad_norm"] > 0.05  # the clip applied, so the norm had to be exact
        assert not torch.equal(ref["greedy_base"], ref["greedy_lora"])  # the adapter steers decoding
        assert_same(ref, got0, d)
        assert_same(ref, got1, d)
        # TP=2's checkpoint in one process: the state it holds is one process's state after the step.
        back = load_and_score(build_runtime(d, None), False, two)
        assert_same(ref["after"][0], back["loaded_state"], f"{d} (saved under TP=2)")
        assert_same(ref["logprobs_after"], back["loaded_logprobs"], f"{d} (saved under TP=2)")


def test_more_ranks_than_key_value_heads_match_one_process(qwen3_dir, tmp_path):
    """Four ranks over 2 key/value heads: each head's K/V projections are kept by the two ranks
    whose query heads read it, their LoRA B gradients summed between those two; logprobs,
    gradients, the clipped step (each shared part counted once in the norm) and checkpoints in
    both directions still equal one process."""
    d = str(qwen3_dir)
    one, four = tmp_path / "tp1", tmp_path / "tp4"
    ref = run_scenario(build_runtime(d, None), sharded=False, save_to=str(one), load_from=str(one))
    outcomes = run_ranks(rank_main, 4, tmp_path / "ranks", ([(d, str(four), str(one))],), timeout_s=60, deadline_s=240)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    assert ref["step"][0]["grad_norm"] > 0.05  # the clip applied, so the norm had to be exact
    for o in outcomes:
        assert_same(ref, o.result[0], f"rank {o.rank}")
    back = load_and_score(build_runtime(d, None), False, str(four))
    assert_same(ref["after"][0], back["loaded_state"], "saved under TP=4")


def test_adapters_stepping_together_on_two_ranks_step_as_each_alone(qwen3_dir, tmp_path):
    """Three adapters' steps taken together (their whole factors' gradients and their norms in one
    all-reduce each, one set of AdamW kernels) leave each adapter bit-identical, on every rank, to
    its step alone (two ranks: an all-reduce adds two parts, whatever sits beside them)."""
    outcomes = run_ranks(joint_steps_rank_main, 2, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert o.result == {"results": [True, True], "states": [[True] * 3] * 2, "clipped": True}, o.result


@pytest.mark.parametrize("families,ranks", [(("qwen3", "qwen3_moe"), 2), (("qwen3",), 4)])
def test_dimuon_on_shards_steps_as_one_process(request, model_dirs, tmp_path, families, ranks):
    """Dimuon orthogonalises whole matrices: each step gathers the split factors' momenta, so two
    clipped steps (the second on the first's momentum) leave the weights, the momentum and the
    logprobs after them as one process leaves them. Qwen3 at two ranks splits B by output rows and
    A by input columns (and the unembedding by vocabulary); its experts' model at two splits the
    routed experts' stacks by expert; at four ranks, two ranks hold each key/value head's B rows alike."""
    dirs = [str(model_dirs[f] if f in model_dirs else request.getfixturevalue(f"{f}_dir")) for f in families]
    refs = [dimuon_scenario(build_runtime(d, None), sharded=False) for d in dirs]
    outcomes = run_ranks(dimuon_rank_main, ranks, tmp_path, (dirs,), timeout_s=60, deadline_s=240)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    for d, ref in zip(dirs, refs):
        assert ref["steps"][0]["grad_norm"] > 0.05  # the clip applied, so the norm had to be exact
        w0, w1 = ref["states"][0][0], ref["states"][1][0]
        assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # the second step moved the weights
    for o in outcomes:
        for d, ref, got in zip(dirs, refs, o.result):
            assert_same(ref, got, f"{d} rank {o.rank}")
