"""Sharded full fine-tuning (FSDP2) over 2 gloo ranks on CPU gives what one process gives, within
1e-5: per-datum logprobs and losses of several calls, two clipped AdamW steps (weights and
optimizer state), logprobs after them; checkpoints move between one process and the group both
ways; bf16 compute over fp32 shards matches one process's bf16 full fine-tune; server-side
custom losses and Dimuon steps match too; a rank that fails makes the other fail within the group's
timeout."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.fsdp_scenario import (CALLS, MICRO_BATCH_TOKENS, bf16_call, bf16_rank_main, build_full_runtime,
                                          custom_rank_main, custom_scenario, dimuon_rank_main, dimuon_scenario,
                                          faulty_rank_main, load_and_score, stepped_checkpoint, stored_load_rank_main,
                                          train_rank_main, train_scenario)
from tests.parallel.scenario import assert_peer_fault_fails_rank0, assert_same
from tinsmith.models.loading import load_model
from tinsmith.parallel.fsdp import phase_counts, plan_ranks, split_datums
from tinsmith.parallel.sharded_dimuon import _owners
from tinsmith.parallel.launch import run_ranks
from tinsmith.worker.batching import SequenceRef
from tinsmith.worker.runtime import TrainingRuntime


def test_split_datums_balances_tokens_deterministically():
    shares = split_datums([9, 5, 13, 7, 4], 2)
    assert shares == [[1, 2], [0, 3, 4]]  # 13+5 tokens and 9+7+4 tokens
    assert sorted(i for s in shares for i in s) == list(range(5))
    assert split_datums([3], 2) == [[0], []]


def test_the_scenario_pads_each_phase():
    """The second call of the scenario leaves a rank with fewer micro-batches with backward, and
    the other with fewer forward-only ones: both padding paths run in the test below."""
    refs = [SequenceRef(r, d, None, n, needs_grad=r < 2) for r, lengths in enumerate(CALLS[1])
            for d, n in enumerate(lengths)]
    counts = [phase_counts(plan) for plan in plan_ranks(refs, 2, MICRO_BATCH_TOKENS, 1 << 30)]
    assert counts[0][True] != counts[1][True] and counts[0][False] != counts[1][False], counts


@pytest.mark.parametrize("tied", [False, True], ids=["qwen3", "tied_qwen3"])
def test_two_ranks_match_one_process(qwen3_dir, tied_qwen3_dir, tmp_path, tied):
    """Also: the group's checkpoint loads in one process, and one process's loads in the group,
    each with the state and logprobs of the process that saved it. (The tied model's embedding
    and LM head are one tensor, trained from both uses; it runs with gradient checkpointing, and
    the untied one recomputes activations in some micro-batches only, different on each rank.)"""
    model_dir = tied_qwen3_dir if tied else qwen3_dir
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    ref = train_scenario(build_full_runtime(str(model_dir), None), save_to=str(one), load_from=str(one))
    outcomes = run_ranks(train_rank_main, 2, tmp_path / "ranks", (str(model_dir), str(two), str(one)),
                         timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    assert all(s["grad_norm"] > 1.0 for s in ref["step"])  # clipping applied: the norm had to be exact
    assert ref["refused"].startswith("InvalidInputError"), ref["refused"]
    weights, _ = ref["after"]
    before = build_full_runtime(str(model_dir), None).unit(0).export_state()[0]
    assert ("lm_head.weight" in weights) != tied
    assert all(not torch.equal(weights[n], before[n]) for n in ("model.layers.0.self_attn.q_proj.weight",
                                                                "model.norm.weight", "model.embed_tokens.weight"))
    kept = [o.result.pop("kept") for o in outcomes]
    assert kept[0][0] == kept[0][2] == len(weights) and kept[0][1] > 0 and kept[1] == (0, 0, 0)
    held = [o.result.pop("held") for o in outcomes]
    for what in ("weights", "grads", "optimizer"):  # each rank holds its half (AdamW: two moments)
        per_model = 2 if what == "optimizer" else 1
        assert sum(h[what] for h in held) == per_model * held[0]["model"], (what, held)
        assert max(h[what] for h in held) <= 0.55 * per_model * held[0]["model"], (what, held)
    for o in outcomes:
        assert_same(ref, o.result, f"rank {o.rank}")
    # The group's checkpoint in one process holds one process's state after the two steps.
    back = load_and_score(build_full_runtime(str(model_dir), None), str(two))
    assert_same(ref["after"], back["state"], "saved under DP=2, loaded in one process")
    assert_same(ref["loaded"]["logprobs"], back["logprobs"], "saved under DP=2, loaded in one process")
    assert_same(ref["loaded"]["stepped"], back["stepped"], "saved under DP=2, loaded in one process")


def test_rank_zero_drives_the_group(qwen3_dir, tmp_path):
    """The same scenario issued by rank 0 alone through the executor (as a server would) while
    rank 1 follows: the same results as one process."""
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    ref = train_scenario(build_full_runtime(str(qwen3_dir), None), save_to=str(one), load_from=str(one))
    outcomes = run_ranks(train_rank_main, 2, tmp_path / "ranks", (str(qwen3_dir), str(two), str(one), True),
                         timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    assert_same(ref, outcomes[0].result, "driver")
    assert outcomes[1].result >= 10  # calls it followed: forward/backward, steps, exports, a load


def test_bf16_compute_matches_one_process_with_fp32_masters(qwen3_dir, tmp_path):
    """The GPU precision policy, on CPU: a bf16 model sharded as fp32 masters and computing in
    bf16 gives one process's bf16 full fine-tune (which keeps fp32 masters): the same logprobs
    (the gathered bf16 weights are the masters rounded alike), the gradient norm within 1e-3, and
    the same fp32 weights after a step except where bf16 gradient rounding tips Adam's first
    update (under 1% of the weights)."""
    model = load_model(str(qwen3_dir), "cpu", torch.bfloat16).model
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    ref = bf16_call(TrainingRuntime(model, full_finetune=True, micro_batch_tokens=MICRO_BATCH_TOKENS))
    outcomes = run_ranks(bf16_rank_main, 2, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        got = o.result
        assert_same(ref["logprobs"], got["logprobs"], f"rank {o.rank} logprobs")
        assert_same(ref["loss"], got["loss"], f"rank {o.rank} loss")
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        assert all(w.dtype == torch.float32 for w in got["weights"].values())
        moved = torch.cat([(ref["weights"][n] - before[n]).flatten() for n in before])
        differ = torch.cat([(got["weights"][n] - ref["weights"][n]).abs().flatten() for n in before]) > 1e-6
        assert moved.abs().gt(0).float().mean() > 0.5  # the step moved most weights
        assert differ.float().mean() < 0.01, float(differ.float().mean())


@pytest.mark.parametrize("fault", ["raise", "exit", "stall"])
def test_peer_fault_fails_the_other_rank(qwen3_dir, tmp_path, fault):
    assert_peer_fault_fails_rank0(faulty_rank_main, qwen3_dir, tmp_path, fault, 3.0)


def test_custom_losses_match_one_process(qwen3_dir, tmp_path):
    """Server-side custom losses run per datum, each rank on its share: logprobs, the losses'
    metrics, the clipped step and the state after it equal one process's; a loss refused on the
    real logprobs on some rank fails its pass (every request of the call) on both ranks alike,
    and the group trains on after it. (Which datum the error names depends on which ran first:
    the lowest rank's, here.)"""
    ref = custom_scenario(build_full_runtime(str(qwen3_dir), None))
    assert ref["step"]["grad_norm"] > 1.0  # clipping applied: the norm had to be exact
    outcomes = run_ranks(custom_rank_main, 2, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    refusals = [[r.pop("refused"), r.pop("refused_pass")] for r in (ref, *(o.result for o in outcomes))]
    assert refusals[1] == refusals[2]  # both ranks fail alike
    for call in refusals:
        for errors in call:
            assert all(e.startswith("InvalidInputError") and "node 'mul'" in e for e in errors), errors
            assert len(set(errors)) == 1  # one pass: every request of it fails with the same error
    for o in outcomes:
        assert_same(ref, o.result, f"rank {o.rank}")


@pytest.mark.parametrize("ranks", [2, 3])
def test_dimuon_matches_one_process(qwen3_dir, tmp_path, ranks):
    """Dimuon on FSDP shards: each whole matrix's direction is computed by its owner rank and its
    rows scattered back, so two clipped steps (the second on the first's momentum) leave the
    weights, momenta and logprobs of one process. Three ranks split some matrices unevenly (the
    last rank holds fewer rows, or none)."""
    ref = dimuon_scenario(build_full_runtime(str(qwen3_dir), None, "dimuon"))
    assert all(s["grad_norm"] > 1.0 for s in ref["step"])  # clipping applied: the norm had to be exact
    (w0, m0), (w1, m1) = ref["after"]
    assert any(k.endswith(".momentum") for k in m1) and any(not torch.equal(w0[k], w1[k]) for k in w0)
    outcomes = run_ranks(dimuon_rank_main, ranks, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same(ref, o.result, f"rank {o.rank}")


def test_dimuon_owners_share_the_work():
    """The costliest matrices (rows x cols x the smaller side) go first, each to the rank with the
    least work so far; matrices held whole (a stack split by expert) are nobody's."""
    shapes = [(8, 64), (64, 8), (32, 32), (4, 4), (16, 16), (64, 64)]
    # costs 4,096, 4,096, 32,768, (whole), 4,096, 262,144
    owners = _owners(shapes, [False, False, False, True, False, False], 2)
    assert owners[5] == 0  # the largest first, onto rank 0
    assert owners[2] == owners[0] == owners[1] == owners[4] == 1  # the rest on rank 1: still less work
    assert _owners(shapes[:3], [False] * 3, 3) == [1, 2, 0]  # three ranks, one each (ties: the first rank free)


def test_each_rank_reads_only_its_rows_of_a_stored_checkpoint(qwen3_dir, tmp_path):
    """A checkpoint left in its files (as the server loads one) loads into the group with each rank
    reading only its rows of each tensor, and holds one process's state; a checkpoint that one
    rank cannot read is refused on both ranks alike, the state unchanged."""
    weights, optimizer = stepped_checkpoint(str(qwen3_dir), str(tmp_path / "ckpt"))
    outcomes = run_ranks(stored_load_rank_main, 2, tmp_path / "ranks", (str(qwen3_dir), str(tmp_path / "ckpt")),
                         timeout_s=30, deadline_s=120)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same((weights, optimizer), o.result["loaded"], f"rank {o.rank}")
        assert "could not be read on every data-parallel rank" in o.result["refused"], o.result["refused"]
        assert_same(o.result["loaded"], o.result["after_refusal"], f"rank {o.rank} after the refusal")
