"""Realistic per-datum custom losses, written the way a researcher writes them for the SDK's
``create_custom_loss``, with the ``input_ranks`` each takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CLIP_LOW, CLIP_HIGH = 0.8, 1.2


def weighted_nll(logprobs, weights):
    """Cross entropy with per-token weights, and how many tokens count."""
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss.detach(), "custom/tokens:mean": weights.sum()}


def ppo_clipped(logprobs, sampler_logprobs, advantages):
    """The PPO clipped surrogate with the fraction of clipped ratios as a metric."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, CLIP_LOW, CLIP_HIGH)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    clip_fraction = ((ratio < CLIP_LOW) | (ratio > CLIP_HIGH)).float().mean()
    return loss, {"custom/clip_fraction:mean": clip_fraction}


def dpo_style(logprobs, ref_logprobs, mask, sign):
    """One side of a DPO pair: ``sign`` is +1 for the chosen answer and -1 for the rejected one;
    the margin is over the answer's tokens (``mask``) against a reference model's logprobs."""
    margin = ((logprobs - ref_logprobs) * mask).sum() * sign
    loss = -F.logsigmoid(0.1 * margin)
    return loss, {"custom/margin:mean": margin.detach()}


def topk_distill(logprobs, teacher_probs):
    """Distillation on [T, K] top-k targets: cross entropy against the teacher's probabilities,
    normalised by the number of rows (shape arithmetic on the traced shape)."""
    rows = logprobs.shape[0]
    loss = -(teacher_probs * logprobs).sum() / rows
    return loss, {"custom/rows:sum": torch.ones_like(loss) * rows}


LOSSES = {
    "weighted_nll": (weighted_nll, {"logprobs": 1, "weights": 1}),
    "ppo_clipped": (ppo_clipped, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}),
    "dpo_style": (dpo_style, {"logprobs": 1, "ref_logprobs": 1, "mask": 1, "sign": 0}),
    "topk_distill": (topk_distill, {"logprobs": 2, "teacher_probs": 2}),
}
