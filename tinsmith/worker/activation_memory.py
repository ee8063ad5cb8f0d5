"""How much activation memory a training token costs, and how many layers to recompute to fit.

The worker sizes micro-batches from free device memory at a rough cost per token: about 20
hidden-sized values per decoder layer kept for backward, plus the routed experts' rows of a
mixture of experts and the chunked delta-rule intermediates of Gated DeltaNet layers. A layer
that recomputes its activations in backward (``torch.utils.checkpoint``) keeps about 4 instead
(its input, and the one layer being recomputed at a time).

A micro-batch larger than the planned size (a single sequence longer than it) need not
recompute every layer: recomputing ``k`` of ``L`` layers brings its activations down to
``(L - k) * full + k * recomputed`` per token, so the smallest ``k`` that fits the planned
budget costs ``k / L`` of a forward in extra compute instead of a whole one (selective
activation checkpointing, as Megatron and torchtune do it by layers).
"""

from __future__ import annotations

import math

from tinsmith.models.config import ModelConfig

KEPT_VALUES = 20  # hidden-sized values a layer keeps per token for its backward
RECOMPUTED_VALUES = 4  # ... when it recomputes its activations in backward
DELTANET_CHUNK = 64  # Gated DeltaNet's chunk length (its per-chunk matrices scale with it)


def layer_bytes_per_token(cfg: ModelConfig, width: int, recomputed: bool) -> float:
    """Mean activation bytes one decoder layer keeps per token (``width``: bytes per value)."""
    if recomputed:
        return RECOMPUTED_VALUES * cfg.hidden_size * width
    per_layer = KEPT_VALUES * cfg.hidden_size * width
    if cfg.moe is not None:
        # each routed copy of a token keeps its input, gate, up, product and output rows
        per_layer += cfg.moe.num_experts_per_tok * (2 * cfg.hidden_size + 3 * cfg.moe.moe_intermediate_size) * width
    if cfg.linear_attn is not None:
        # Gated DeltaNet layers keep, in fp32, three chunk-wide decay/system matrices per value
        # head and the q/k/v/output rows of every token (averaged over all layers here).
        la = cfg.linear_attn
        rows = 2 * la.num_value_heads * la.key_head_dim + 2 * la.num_value_heads * la.value_head_dim
        linear_layers = sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers))
        per_layer += linear_layers / cfg.num_layers * (3 * la.num_value_heads * DELTANET_CHUNK + 2 * rows) * 4
    return per_layer


def activation_bytes_per_token(cfg: ModelConfig, width: int, recomputed_layers: int = 0) -> float:
    """Activation bytes a training token costs when ``recomputed_layers`` of the decoder layers
    recompute theirs in backward."""
    k = min(max(recomputed_layers, 0), cfg.num_layers)
    return ((cfg.num_layers - k) * layer_bytes_per_token(cfg, width, False)
            + k * layer_bytes_per_token(cfg, width, True))


def layers_to_recompute(cfg: ModelConfig, tokens: int, budget_tokens: int | None, width: int = 2) -> int:
    """The fewest decoder layers that must recompute their activations for a micro-batch of
    ``tokens`` to keep no more than one of ``budget_tokens`` keeping all of them (None: no
    budget, none), ``width`` bytes per activation value. Every layer when even that is not
    enough: what fits no better is tried, and running out of memory is handled where it happens."""
    if budget_tokens is None or tokens <= budget_tokens:
        return 0
    L = cfg.num_layers
    full = layer_bytes_per_token(cfg, width, False)
    saved = full - layer_bytes_per_token(cfg, width, True)
    # tokens * ((L - k) * full + k * recomputed) <= budget_tokens * L * full
    k = math.ceil(L * full * (tokens - budget_tokens) / (tokens * saved) - 1e-9)
    return min(max(k, 1), L)


def recomputed_layer_indices(count: int, layers: int) -> frozenset[int]:
    """Which ``count`` of ``layers`` decoder layers recompute: spread evenly, so that the memory
    they free is spread along the network (half: every other layer)."""
    count = min(max(count, 0), layers)
    return frozenset((j * layers) // count for j in range(count)) if count else frozenset()
