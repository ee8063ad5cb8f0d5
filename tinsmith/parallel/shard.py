"""Turn a loaded :class:`CausalLM` into this rank's tensor-parallel shard of it, in place.

Each rank loads the whole checkpoint and keeps its slices (simple, and enough while a model fits
in host memory); the rest is freed. Attention heads are split contiguously, so rank ``r`` keeps
query heads ``r*H/tp ...`` and exactly the key/value heads those use (grouped-query attention
maps query head ``i`` to kv head ``i // (H/Hk)``).
"""

from __future__ import annotations

from torch import nn

from tinsmith.models.layers import MLP, CausalLM
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.layers import ColumnParallelLoraLinear, CopyToTP, RowParallelLoraLinear, VocabParallelEmbedding


def check_shardable(model: CausalLM, tp: TPGroup) -> None:
    """Refuse, with the reason, a model this slice of tensor parallelism does not cover."""
    cfg = model.config
    if cfg.moe is not None or any(not isinstance(layer.mlp, MLP) for layer in model.model.layers):
        raise ValueError("tensor parallelism covers dense models (Qwen3, Llama, Qwen2) so far, not mixture-of-experts")
    if cfg.attention_sinks or cfg.vision is not None:
        raise ValueError("tensor parallelism does not cover attention sinks (gpt-oss) or vision towers yet")
    for n, what in ((cfg.num_heads, "attention heads"), (cfg.num_kv_heads, "key/value heads"),
                    (cfg.intermediate_size, "MLP intermediate size"), (cfg.vocab_size, "vocabulary size")):
        tp.shard(n, what)  # raises when not divisible


def shard_causal_lm(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Keep this rank's shard of every projection, the embedding and the LM head; returns ``model``."""
    check_shardable(model, tp)
    cfg = model.config
    d = cfg.head_dim
    q_heads, kv_heads = tp.shard(cfg.num_heads, "attention heads"), tp.shard(cfg.num_kv_heads, "key/value heads")
    q_rows = slice(q_heads.start * d, q_heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    inter = tp.shard(cfg.intermediate_size, "MLP intermediate size")
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
        attn.packed_qkv = None  # packed buffers hold full weights; the shards run separately
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
