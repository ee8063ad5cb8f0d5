"""The communication pattern of a training step, counted: what Megatron-style TP should issue and
no more (a guard against a change that adds collectives to the hot path)."""

from __future__ import annotations

import math
import os

from tests.parallel.scenario import collective_counts
from tinsmith.parallel.launch import run_ranks


def test_collectives_per_forward_backward_and_step(qwen3_dir, tmp_path):
    (r0, r1) = run_ranks(collective_counts, 2, tmp_path, (str(qwen3_dir),), timeout_s=30, deadline_s=90)
    assert r0.exitcode == 0 and r1.exitcode == 0, r0.error or r1.error
    layers, chunks = 2, math.ceil(64 / 5)  # the tiny model's layers; 5-row logit chunks over 64 tokens
    # Forward: the embedding, o_proj and down_proj per layer, then max and (sum-exp, target) per chunk.
    forward = 1 + 2 * layers + 2 * chunks
    # Backward: one input-gradient sum per attention and per MLP (none into layer 0's attention,
    # whose input needs no gradient under LoRA), and one for the head's input.
    backward = (2 * layers - 1) + 1
    assert r0.result == r1.result == {
        "forward": {"all_reduce": forward},
        "forward+backward": {"all_reduce": forward + backward},
        "step": {"all_reduce": 2},  # the whole factors' partial gradients, the gradient norm
        "steps_together": {"all_reduce": 2},  # three adapters' steps: the same two, for all of them
    }


def graph_peers_main(tp) -> dict:
    """What a tensor-parallel sampler's decode graphs hear from :class:`GraphPeers` on this rank."""
    import torch

    from tinsmith.parallel.sampling import GraphPeers

    peers = GraphPeers(tp, torch.device("cpu"))
    out = {"all_ok": peers.all_ok(True), "one_failed": peers.all_ok(tp.rank != 1)}
    peers.fence()
    peers.fence()
    out["fence"] = peers._fence.tolist()  # a sum of zeros: the fence carries nothing
    return out


def test_graph_peers_agree_on_captures(tmp_path):
    """A capture that failed on one rank is a failure on every rank (they must all go back to the
    eager step together); the fence is a collective every rank makes alike."""
    outcomes = run_ranks(graph_peers_main, 2, tmp_path, timeout_s=30, deadline_s=90)
    for o in outcomes:
        assert o.exitcode == 0, o.error
        assert o.result == {"all_ok": True, "one_failed": False, "fence": [0.0]}


def test_nccl_groups_raise_rather_than_end_the_process(monkeypatch):
    """PyTorch's NCCL watchdog ends the process on a failed collective by default; a group made
    here asks it to abort the communicator (so the collective raises), unless the operator chose."""
    from tinsmith.parallel.group import NCCL_ERROR_HANDLING, nccl_errors_fail_collectives

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl_errors_fail_collectives()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == NCCL_ERROR_HANDLING == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl_errors_fail_collectives()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
