"""Turn a loaded :class:`CausalLM` into this rank's tensor-parallel shard of it, in place.

Each rank reads the whole checkpoint and keeps its slices (:func:`load_shard`): the files are
memory-mapped, the projections left unpacked, and each decoder layer is cut as soon as it is
loaded, so what a rank reads is page cache shared by all ranks, and what it keeps is its shard
(its q/k/v and gate/up rows then packed side by side, as one process packs them whole). Attention heads are split contiguously, so rank ``r`` keeps
query heads ``r*H/tp ...`` and exactly the key/value heads those use (grouped-query attention
maps query head ``i`` to kv head ``i // (H/Hk)``). Dense MLPs are split Megatron-style (gate/up
by columns, down by rows); a mixture-of-experts layer is split by experts instead (each rank
keeps ``experts/tp`` whole experts and the router), which needs no collective beyond the one
after the layer and keeps every expert's matmuls at full width.
"""

from __future__ import annotations

import torch
from torch import nn

from tinsmith.models.config import ModelConfig
from tinsmith.models.gated_deltanet import GatedDeltaNet
from tinsmith.models.layers import Attention, CausalLM, SharedExpertMoeBlock
from tinsmith.models.loading import LoadedModel, load_model, read_config, resolve_model_dir
from tinsmith.models.lora import PackedProjection
from tinsmith.models.moe import SparseMoeBlock
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.layers import (ColumnParallelLoraLinear, CopyToTP, ExpertParallelMoeBlock,
                                      ExpertParallelSharedMoeBlock, RowParallelLoraLinear, VocabParallelEmbedding)


def check_shardable(model: CausalLM, tp: TPGroup) -> None:
    """Refuse, with the reason, a model whose counts the tensor-parallel size does not divide.
    (An image-text model's decoder is sharded like any other; its frozen vision tower is not part
    of ``model`` and runs whole on every rank.)"""
    check_shardable_config(model.config, tp)


def check_shardable_config(cfg: ModelConfig, tp: TPGroup) -> None:
    """:func:`check_shardable` from the model's config alone (before anything is loaded)."""
    for n, what in tp_divisors(cfg):
        tp.shard(n, what)  # raises when not divisible
    kv_heads_of_rank(cfg, tp)  # raises when the key/value heads neither divide nor are divided by the size


def tp_divisors(cfg: ModelConfig) -> list[tuple[int, str]]:
    """The counts a tensor-parallel size must divide: query heads, vocabulary, and (where the model
    has such layers) the MLP width, the number of experts and the shared expert's width, and the
    linear-attention key heads (each rank keeps whole heads of every kind). Key/value heads are
    :func:`kv_heads_of_rank`'s: there the size may also be a multiple of them."""
    out = [(cfg.num_heads, "attention heads"), (cfg.vocab_size, "vocabulary size")]
    moe_layers = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    if not all(moe_layers):
        out.append((cfg.intermediate_size, "MLP intermediate size"))
    if any(moe_layers):
        assert cfg.moe is not None
        out.append((cfg.moe.num_experts, "experts"))
        if cfg.moe.shared_expert_intermediate_size:
            out.append((cfg.moe.shared_expert_intermediate_size, "shared expert intermediate size"))
    if cfg.linear_attn is not None:
        out.append((cfg.linear_attn.num_key_heads, "linear-attention key heads"))
    return out


def shard_causal_lm(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Keep this rank's shard of every projection, the embedding and the LM head; returns ``model``."""
    check_shardable(model, tp)
    for i in range(len(model.model.layers)):
        shard_layer(model, i, tp)
    return shard_root(model, tp)


def load_shard(model_dir: str, tp: TPGroup, dtype: torch.dtype) -> LoadedModel:
    """This rank's shard of the checkpoint at ``model_dir``, in host memory.

    Each decoder layer is cut as soon as it is loaded, before the next is read, so a rank never
    holds more than one whole layer beside its shard: the files are memory-mapped (page cache,
    shared by the ranks), and what a layer costs whole (experts stacked from per-expert tensors,
    dequantised MXFP4 experts, a conversion from the stored dtype) is freed once its slices are
    taken.
    """
    check_shardable_config(read_config(resolve_model_dir(model_dir)), tp)
    loaded = load_model(model_dir, "cpu", dtype, pack=False, on_layer=lambda model, i: shard_layer(model, i, tp))
    shard_root(loaded.model, tp)
    return loaded


def shard_layer(model: CausalLM, i: int, tp: TPGroup) -> None:
    """Keep this rank's shard of decoder layer ``i``'s projections (in place)."""
    cfg = model.config
    layer = model.model.layers[i]
    # The norms before attention and the MLP mark where the replicated stream enters sharded
    # work (one gradient all-reduce each), so their projections do not each do it again.
    layer.input_layernorm = CopyToTP(layer.input_layernorm, tp)
    layer.post_attention_layernorm = CopyToTP(layer.post_attention_layernorm, tp)
    if hasattr(layer, "linear_attn"):
        _shard_gated_deltanet(layer.linear_attn, tp)
    else:
        _shard_attention(layer.self_attn, cfg, tp)
    layer.mlp = _shard_feed_forward(layer.mlp, cfg, tp)


def shard_root(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Keep this rank's vocabulary rows of the embedding and the LM head; returns ``model``."""
    cfg = model.config
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


def kv_heads_of_rank(cfg: ModelConfig, tp: TPGroup) -> tuple[slice, torch.Tensor | None]:
    """The key/value heads rank ``tp.rank`` keeps, and (when the size exceeds them) the order of
    the K/V projections' rows over the ranks.

    With at least as many key/value heads as ranks, each rank keeps its block of them. With
    more ranks (Qwen3-235B-A22B: 4 key/value heads at TP=8), each head is kept by ``size /
    heads`` consecutive ranks, those whose query heads read it: the K/V projections are
    replicated within each such set, and their LoRA ``B`` rows' gradients summed among it."""
    hk = cfg.num_kv_heads
    if tp.size <= hk or tp.size % hk:
        return tp.shard(hk, "key/value heads"), None
    # The query heads divide by the size (checked before), so each rank's query heads read one head.
    copies = tp.size // hk
    head = tp.rank // copies
    d = cfg.head_dim
    order = torch.cat([torch.arange((r // copies) * d, (r // copies + 1) * d) for r in range(tp.size)])
    return slice(head, head + 1), order


def _shard_attention(attn: Attention, cfg: ModelConfig, tp: TPGroup) -> None:
    d = cfg.head_dim
    q_heads = tp.shard(cfg.num_heads, "attention heads")
    kv_heads, kv_order = kv_heads_of_rank(cfg, tp)
    q_rows = slice(q_heads.start * d, q_heads.stop * d)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    # Gated attention (Qwen3.5): each head's query rows are followed by its gate's, so a rank's
    # heads are still one block of q_proj's rows, twice as tall.
    per = 2 * d if attn.output_gate else d
    attn.q_proj = ColumnParallelLoraLinear(attn.q_proj, slice(q_heads.start * per, q_heads.stop * per), tp,
                                           copy_input=False)
    attn.k_proj = ColumnParallelLoraLinear(attn.k_proj, None if kv_order is not None else kv_rows, tp,
                                           copy_input=False, order=kv_order)
    attn.v_proj = ColumnParallelLoraLinear(attn.v_proj, None if kv_order is not None else kv_rows, tp,
                                           copy_input=False, order=kv_order)
    attn.o_proj = RowParallelLoraLinear(attn.o_proj, q_rows, tp)
    attn.num_heads, attn.num_kv_heads = q_heads.stop - q_heads.start, kv_heads.stop - kv_heads.start
    if attn.sinks is not None:  # gpt-oss: one frozen sink logit per query head, kept with its head
        attn.sinks = nn.Parameter(attn.sinks.detach()[q_heads].clone(), requires_grad=False)
    # This rank's q, k and v rows in one buffer: one GEMM at inference, as in one process (the
    # shards' forward adds nothing at inference; training runs each shard's own forward).
    attn.packed_qkv = None if attn.output_gate else PackedProjection([attn.q_proj, attn.k_proj, attn.v_proj])


def _shard_gated_deltanet(la: GatedDeltaNet, tp: TPGroup) -> None:
    """Split a Gated DeltaNet layer by key heads, each rank keeping the value heads those serve.

    The fused q/k/v projection (and the depthwise convolution over its channels) holds q, then k,
    then v rows: a rank's share is its heads' rows of each, so that projection is cut by a
    permutation rather than one block. Everything else per value head (z, b, a, the decay's
    ``A_log`` and ``dt_bias``) is a block; the gated norm acts within a head (replicated); the
    output projection is row-parallel."""
    keys = tp.shard(la.nk, "linear-attention key heads")
    rep = la.nv // la.nk
    values = slice(keys.start * rep, keys.stop * rep)
    kd, vd = la.nk * la.dk, la.nv * la.dv
    per_rank = [torch.cat((torch.arange(r * kd // tp.size, (r + 1) * kd // tp.size),
                           kd + torch.arange(r * kd // tp.size, (r + 1) * kd // tp.size),
                           2 * kd + torch.arange(r * vd // tp.size, (r + 1) * vd // tp.size))) for r in range(tp.size)]
    order = torch.cat(per_rank)
    la.in_proj_qkv = ColumnParallelLoraLinear(la.in_proj_qkv, None, tp, copy_input=False, order=order)
    value_rows = slice(values.start * la.dv, values.stop * la.dv)
    la.in_proj_z = ColumnParallelLoraLinear(la.in_proj_z, value_rows, tp, copy_input=False)
    la.in_proj_b = ColumnParallelLoraLinear(la.in_proj_b, values, tp, copy_input=False)
    la.in_proj_a = ColumnParallelLoraLinear(la.in_proj_a, values, tp, copy_input=False)
    la.out_proj = RowParallelLoraLinear(la.out_proj, value_rows, tp)
    mine = per_rank[tp.rank]
    la.conv1d.weight = nn.Parameter(la.conv1d.weight.detach()[mine].clone(), requires_grad=False)
    la.dt_bias = nn.Parameter(la.dt_bias.detach()[values].clone(), requires_grad=False)
    la.A_log = nn.Parameter(la.A_log.detach()[values].clone(), requires_grad=False)
    la.nk, la.nv = keys.stop - keys.start, values.stop - values.start
    la.packed_in = None


def _shard_feed_forward(mlp: nn.Module, cfg: ModelConfig, tp: TPGroup) -> nn.Module:
    if isinstance(mlp, SharedExpertMoeBlock):
        assert cfg.moe is not None
        return ExpertParallelSharedMoeBlock(mlp, tp.shard(cfg.moe.num_experts, "experts"),
                                            tp.shard(cfg.moe.shared_expert_intermediate_size,
                                                     "shared expert intermediate size"), tp)
    if isinstance(mlp, SparseMoeBlock):  # expert parallel: this rank's block of experts
        assert cfg.moe is not None
        return ExpertParallelMoeBlock(mlp, tp.shard(cfg.moe.num_experts, "experts"), tp)
    inter = tp.shard(cfg.intermediate_size, "MLP intermediate size")
    mlp.gate_proj = ColumnParallelLoraLinear(mlp.gate_proj, inter, tp, copy_input=False)
    mlp.up_proj = ColumnParallelLoraLinear(mlp.up_proj, inter, tp, copy_input=False)
    mlp.down_proj = RowParallelLoraLinear(mlp.down_proj, inter, tp)
    mlp.packed_gate_up = PackedProjection([mlp.gate_proj, mlp.up_proj])  # this rank's gate and up columns
    return mlp


def tp_of(model: nn.Module) -> TPGroup:
    """The group a sharded model belongs to (a group of one for an unsharded model)."""
    return getattr(model, "tp", None) or TPGroup.single()
