"""In one process (no collective runs): how a model and its adapters are cut into shards, and
how full-size adapter state is cut and reassembled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinsmith.errors import InvalidInputError
from tinsmith.models.loading import load_model, read_config
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.layers import ExpertParallelMoeBlock
from tinsmith.parallel.serving import check_servable
from tinsmith.parallel.shard import load_shard, shard_causal_lm, tp_divisors
from tinsmith.parallel.state import lora_shard_dims, scatter_full
from tinsmith.types import LoraSpec
from tinsmith.worker.trainables import attach_lora


def _adapter(model_dir, tp: TPGroup | None) -> tuple[dict[str, torch.Tensor], dict]:
    model = load_model(str(model_dir), "cpu", torch.float32).model
    if tp is not None:
        shard_causal_lm(model, tp)
    tr = attach_lora(model, 0, LoraSpec(rank=4, seed=11))
    return {n: p.detach() for n, p in tr.named_params}, lora_shard_dims(model)


def test_seeded_adapter_shards_are_slices_of_the_full_adapter(qwen3_dir):
    full, _ = _adapter(qwen3_dir, None)
    shards = [_adapter(qwen3_dir, TPGroup(rank=r, size=2)) for r in range(2)]
    dims = shards[0][1]
    assert dims["model.layers.0.self_attn.q_proj.lora_B.weight"] == 0  # column: B split by output
    assert dims["model.layers.0.self_attn.q_proj.lora_A.weight"] is None
    assert dims["model.layers.1.mlp.down_proj.lora_A.weight"] == 1  # row: A split by input
    assert dims["lm_head.lora_B.weight"] == 0  # vocabulary rows
    for name, t in full.items():
        d = dims[name]
        parts = [s[0][name] for s in shards]
        if d is None:
            assert all(torch.equal(p, t) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=d), t), name
        # Cutting the full tensor gives exactly what each rank drew for itself.
        for r in range(2):
            assert torch.equal(scatter_full({name: t}, dims, TPGroup(rank=r, size=2))[name], parts[r]), name


def test_optimizer_state_is_cut_like_its_tensor_and_steps_stay_whole():
    dims = {"x.lora_A.weight": 1, "x.lora_B.weight": None}
    full = {"x.lora_A.weight.exp_avg": torch.arange(8.0).reshape(2, 4), "x.lora_A.weight.step": torch.ones(1),
            "x.lora_B.weight.exp_avg": torch.arange(6.0).reshape(3, 2)}
    r1 = scatter_full(full, dims, TPGroup(rank=1, size=2))
    assert torch.equal(r1["x.lora_A.weight.exp_avg"], torch.tensor([[2.0, 3.0], [6.0, 7.0]]))
    assert torch.equal(r1["x.lora_A.weight.step"], torch.ones(1))
    assert torch.equal(r1["x.lora_B.weight.exp_avg"], full["x.lora_B.weight.exp_avg"])
    with pytest.raises(ValueError, match="not divisible"):
        scatter_full({"x.lora_A.weight": torch.zeros(2, 5)}, dims, TPGroup(rank=0, size=2))


def test_refuses_what_it_cannot_shard(qwen3_dir, qwen3_moe_dir, qwen3_5_moe_dir, qwen3_vl_dir):
    model = load_model(str(qwen3_dir), "cpu", torch.float32).model
    with pytest.raises(ValueError, match="attention heads .4. is not divisible by the tensor-parallel size 3"):
        shard_causal_lm(model, TPGroup(rank=0, size=3))
    vl = load_model(str(qwen3_vl_dir), "cpu", torch.float32).model  # its decoder shards like Qwen3's
    assert shard_causal_lm(vl, TPGroup(rank=0, size=2)).model.layers[0].self_attn.num_heads == 2
    hybrid = read_config(qwen3_5_moe_dir)
    assert (hybrid.linear_attn.num_key_heads, "linear-attention key heads") in tp_divisors(hybrid)
    assert (hybrid.moe.shared_expert_intermediate_size, "shared expert intermediate size") in tp_divisors(hybrid)
    moe = load_model(str(qwen3_moe_dir), "cpu", torch.float32).model
    cfg = moe.config
    assert (cfg.moe.num_experts, "experts") in tp_divisors(cfg)
    assert (cfg.intermediate_size, "MLP intermediate size") not in tp_divisors(cfg)  # no dense MLP layer
    six = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=6))
    with pytest.raises(InvalidInputError, match=r"experts \(6\) do not divide by 4"):
        check_servable(dataclasses.replace(six, num_heads=8, num_kv_heads=4, vocab_size=cfg.vocab_size * 4), 4, "six")


def test_experts_split_by_rank(qwen3_moe_dir):
    """Rank 1 of 2 keeps the second half of every layer's experts, whole, and adapters drawn from a
    seed hold that rank's experts of the full-size draw."""
    full = load_model(str(qwen3_moe_dir), "cpu", torch.float32).model
    moe = shard_causal_lm(load_model(str(qwen3_moe_dir), "cpu", torch.float32).model, TPGroup(rank=1, size=2))
    n = full.config.moe.num_experts
    for whole, part in zip(full.model.layers, moe.model.layers):
        assert isinstance(part.mlp, ExpertParallelMoeBlock) and part.mlp.expert_start == n // 2
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(part.mlp.experts, name).weight, getattr(whole.mlp.experts, name).weight[n // 2:])
        assert torch.equal(part.mlp.gate.weight, whole.mlp.gate.weight)  # the router stays whole
    a = full.model.layers[0].mlp.experts.down_proj.add_adapter(1, 4, 8.0, torch.Generator().manual_seed(3))
    b = moe.model.layers[0].mlp.experts.down_proj.add_adapter(1, 4, 8.0, torch.Generator().manual_seed(3))
    assert torch.equal(b.A, a.A[n // 2:]) and torch.equal(b.B, a.B[n // 2:])


@pytest.mark.parametrize("fixture", ["qwen3_moe_dir", "qwen3_5_moe_dir", "gpt_oss_dir", "tied_qwen3_dir"])
def test_loading_a_shard_layer_by_layer_cuts_what_cutting_the_whole_model_cuts(request, fixture):
    """load_shard cuts each layer as soon as it is read (experts stacked, DeltaNet permuted, sinks,
    a tied head): every rank ends with the tensors the whole model cut at once gives it."""
    model_dir = str(request.getfixturevalue(fixture))
    for rank in range(2):
        tp = TPGroup(rank=rank, size=2)
        want = dict(shard_causal_lm(load_model(model_dir, "cpu", torch.float32).model, tp).named_parameters())
        loaded = load_shard(model_dir, tp, torch.float32)
        got = dict(loaded.model.named_parameters())
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), (rank, name)
        assert loaded.model.tp is tp
        tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
        assert tied == (fixture == "tied_qwen3_dir")
