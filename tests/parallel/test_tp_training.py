"""Tensor parallelism over 2 gloo ranks on CPU gives what one process gives, within 1e-5:
logprobs, loss, LoRA gradients (gathered to full size), one clipped AdamW step (weights and
optimizer state), logprobs after it, and greedy decoding with and without an adapter."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.scenario import build_runtime, load_and_score, rank_main, run_scenario
from tinsmith.parallel.launch import run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _assert_close(ref, got, where: str = "") -> None:
    if isinstance(ref, dict):
        assert sorted(ref) == sorted(got), where
        for k in ref:
            _assert_close(ref[k], got[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ref) == len(got), where
        for i, (a, b) in enumerate(zip(ref, got)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor) and not ref.is_floating_point():
        assert torch.equal(ref, got), f"{where}: {ref} != {got}"
    else:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(ref), **TOL, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("families", [("qwen3", "tied_qwen3"), ("llama", "qwen2")])
def test_two_ranks_match_one_process(model_dirs, tied_qwen3_dir, tmp_path, families):
    """Also: a checkpoint saved by one process loads under TP=2, and one saved (gathered) under
    TP=2 loads in one process, with the same state and logprobs. Two families per group of ranks."""
    dirs = [str(tied_qwen3_dir if f == "tied_qwen3" else model_dirs[f]) for f in families]
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
        _assert_close(ref, got0, d)
        _assert_close(ref, got1, d)
        # TP=2's checkpoint in one process: the state it holds is one process's state after the step.
        back = load_and_score(build_runtime(d, None), False, two)
        _assert_close(ref["after"][0], back["loaded_state"], f"{d} (saved under TP=2)")
        _assert_close(ref["logprobs_after"], back["loaded_logprobs"], f"{d} (saved under TP=2)")
