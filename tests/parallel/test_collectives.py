"""The communication pattern of a training step, counted: what Megatron-style TP should issue and
no more (a guard against a change that adds collectives to the hot path)."""

from __future__ import annotations

import math

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
    }
