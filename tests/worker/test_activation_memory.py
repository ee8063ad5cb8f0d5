"""Selective activation recomputation: the planner's choice of layers, and a model that recomputes
some of its layers computes exactly what it computes keeping all, while keeping less."""

from __future__ import annotations

import pytest
import torch

from tinsmith.models.config import ModelConfig
from tinsmith.models.loading import load_model, read_config
from tinsmith.types import LoraSpec
from tinsmith.worker.activation_memory import (activation_bytes_per_token, layers_to_recompute,
                                               recomputed_layer_indices)
from tinsmith.worker.trainables import attach_lora


@pytest.fixture(scope="module")
def configs(qwen3_dir, qwen3_moe_dir, qwen3_5_dir) -> list[ModelConfig]:
    return [read_config(d) for d in (qwen3_dir, qwen3_moe_dir, qwen3_5_dir)]


def test_the_planner_picks_the_fewest_layers_that_fit(configs):
    for cfg in configs:
        L, budget = cfg.num_layers, 1000
        whole = budget * activation_bytes_per_token(cfg, 2)
        assert layers_to_recompute(cfg, budget, budget) == 0
        assert layers_to_recompute(cfg, 10 * budget, None) == 0  # no budget: as configured
        previous = 0
        for tokens in range(budget + 1, 5 * budget, 97):
            k = layers_to_recompute(cfg, tokens, budget, 2)
            assert 1 <= k <= L and k >= previous, (cfg.family, tokens, k)
            previous = k
            if k < L:
                assert tokens * activation_bytes_per_token(cfg, 2, k) <= whole * (1 + 1e-9), (cfg.family, tokens)
            assert tokens * activation_bytes_per_token(cfg, 2, k - 1) > whole, (cfg.family, tokens, k)
        # far beyond what recomputing everything can bring down: every layer, the most it can do
        assert layers_to_recompute(cfg, 100 * budget, budget) == L


def test_recomputed_layers_are_spread_along_the_network():
    assert recomputed_layer_indices(0, 8) == frozenset()
    assert recomputed_layer_indices(2, 8) == {0, 4}
    assert recomputed_layer_indices(4, 8) == {0, 2, 4, 6}
    assert recomputed_layer_indices(3, 4) == {0, 1, 2}
    assert recomputed_layer_indices(9, 8) == frozenset(range(8))


def _run(model, tokens, unit) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Forward and backward of a LoRA-trained model; the hidden states, the LoRA gradients and
    the bytes autograd kept for the backward outside recomputed layers."""
    kept = [0]

    def pack(t: torch.Tensor):
        kept[0] += t.numel() * t.element_size()
        return t

    for p in unit.params:
        p.grad = None
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    segments = [(unit.slot, 0, tokens.shape[0])]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = model.hidden_states(tokens, positions, segments)
    (h.float().pow(2).mean()).backward()
    return h.detach(), {n: p.grad.clone() for n, p in unit.named_params if p.grad is not None}, kept[0]


@pytest.mark.parametrize("fixture", ["qwen3_dir", "qwen3_5_dir"])
def test_recomputing_some_layers_changes_nothing_but_the_memory_kept(request, fixture):
    model = load_model(str(request.getfixturevalue(fixture)), "cpu", torch.float32).model
    unit = attach_lora(model, 1, LoraSpec(rank=4, seed=5))
    with torch.no_grad():
        for n, p in unit.named_params:
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(7))
    tokens = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(1))
    L = model.config.num_layers
    runs = []
    for count in range(L):
        model.recomputed_layers = recomputed_layer_indices(count, L)
        runs.append(_run(model, tokens, unit))
    model.recomputed_layers = frozenset()
    model.gradient_checkpointing = True
    runs.append(_run(model, tokens, unit))
    model.gradient_checkpointing = False
    h0, g0, kept0 = runs[0]
    for h, g, _ in runs[1:]:
        torch.testing.assert_close(h, h0, rtol=0, atol=0)
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-6, atol=1e-7, msg=n)
    kept = [r[2] for r in runs]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == len(kept), kept
    if model.config.linear_attn is not None:
        return  # a hybrid's layers differ: each recomputed one gives back what it kept, unequal shares
    per_layer = (kept[0] - kept[-1]) / L  # what one layer keeps beyond its recomputed input, about
    for count in range(L + 1):  # each recomputed layer gives back about one layer's share
        assert kept[count] == pytest.approx(kept[0] - count * per_layer, rel=0.25), kept
