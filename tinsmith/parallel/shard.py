"""Turn a loaded :class:`CausalLM` into this rank's tensor-parallel shard of it, in place.

Each rank loads the whole checkpoint and keeps its slices (simple, and enough while a model fits
in host memory); the rest is freed. Attention heads are split contiguously, so rank ``r`` keeps
query heads ``r*H/tp ...`` and exactly the key/value heads those use (grouped-query attention
maps query head ``i`` to kv head ``i // (H/Hk)``). Dense MLPs are split Megatron-style (gate/up
by columns, down by rows); a mixture-of-experts layer is split by experts instead (each rank
keeps ``experts/tp`` whole experts and the router), which needs no collective beyond the one
after the layer and keeps every expert's matmuls at full width.
"""

from __future__ import annotations

from torch import nn

from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import MLP, CausalLM
from tinsmith.models.moe import SparseMoeBlock
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.layers import (ColumnParallelLoraLinear, CopyToTP, ExpertParallelMoeBlock, RowParallelLoraLinear,
                                      VocabParallelEmbedding)


def check_shardable(model: CausalLM, tp: TPGroup) -> None:
    """Refuse, with the reason, a model this slice of tensor parallelism does not cover."""
    cfg = model.config
    if any(not isinstance(layer.mlp, MLP) and type(layer.mlp) is not SparseMoeBlock for layer in model.model.layers):
        raise ValueError("tensor parallelism covers dense MLPs and routed experts without a shared expert so far")
    if cfg.vision is not None or cfg.linear_attn is not None:
        raise ValueError("tensor parallelism does not cover vision towers or Gated DeltaNet layers yet")
    for n, what in tp_divisors(cfg):
        tp.shard(n, what)  # raises when not divisible


def tp_divisors(cfg: ModelConfig) -> list[tuple[int, str]]:
    """The counts a tensor-parallel size must divide: heads, vocabulary, and the MLP width or the
    number of experts (each where the model has such layers)."""
    out = [(cfg.num_heads, "attention heads"), (cfg.num_kv_heads, "key/value heads"), (cfg.vocab_size, "vocabulary size")]
    moe_layers = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    if not all(moe_layers):
        out.append((cfg.intermediate_size, "MLP intermediate size"))
    if any(moe_layers):
        out.append((cfg.moe.num_experts, "experts"))
    return out


def shard_causal_lm(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Keep this rank's shard of every projection, the embedding and the LM head; returns ``model``."""
    check_shardable(model, tp)
    cfg = model.config
    d = cfg.head_dim
    q_heads, kv_heads = tp.shard(cfg.num_heads, "attention heads"), tp.shard(cfg.num_kv_heads, "key/value heads")
    q_rows = slice(q_heads.start * d, q_heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # The norms before attention and the MLP mark where the replicated stream enters sharded
        # work (one gradient all-reduce each), so their projections do not each do it again.
        layer.input_layernorm = CopyToTP(layer.input_layernorm, tp)
        layer.post_attention_layernorm = CopyToTP(layer.post_attention_layernorm, tp)
        attn.q_proj = ColumnParallelLoraLinear(attn.q_proj, q_rows, tp, copy_input=False)
        attn.k_proj = ColumnParallelLoraLinear(attn.k_proj, kv_rows, tp, copy_input=False)
        attn.v_proj = ColumnParallelLoraLinear(attn.v_proj, kv_rows, tp, copy_input=False)
        attn.o_proj = RowParallelLoraLinear(attn.o_proj, q_rows, tp)
        attn.num_heads, attn.num_kv_heads = q_heads.stop - q_heads.start, kv_heads.stop - kv_heads.start
        if attn.sinks is not None:  # gpt-oss: one frozen sink logit per query head, kept with its head
            attn.sinks = nn.Parameter(attn.sinks.detach()[q_heads].clone(), requires_grad=False)
        attn.packed_qkv = None  # packed buffers hold full weights; the shards run separately
        if isinstance(mlp, SparseMoeBlock):  # expert parallel: this rank's block of experts
            layer.mlp = ExpertParallelMoeBlock(mlp, tp.shard(cfg.moe.num_experts, "experts"), tp)
            continue
        inter = tp.shard(cfg.intermediate_size, "MLP intermediate size")
        mlp.gate_proj = ColumnParallelLoraLinear(mlp.gate_proj, inter, tp, copy_input=False)
        mlp.up_proj = ColumnParallelLoraLinear(mlp.up_proj, inter, tp, copy_input=False)
        mlp.down_proj = RowParallelLoraLinear(mlp.down_proj, inter, tp)
        mlp.packed_gate_up = None
    vocab = tp.shard(cfg.vocab_size, "vocabulary size")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embed = VocabParallelEmbedding(model.model.embed_tokens, vocab, tp)
    model.model.embed_tokens = embed
    # The head's forward gathers full logits (``model.logits`` stays whole for the sampler);
    # training reads its shard directly (:mod:`tinsmith.parallel.logprobs`).
    model.lm_head = ColumnParallelLoraLinear(model.lm_head, vocab, tp, weight=embed.weight if tied else None,
                                             gather_output=True)
    model.tp = tp  # type: ignore[assignment]  (read by the runtime and the decode loop)
    return model


def tp_of(model: nn.Module) -> TPGroup:
    """The group a sharded model belongs to (a group of one for an unsharded model)."""
    return getattr(model, "tp", None) or TPGroup.single()
