"""Model configuration read from a Hugging Face ``config.json``.

One dataclass covers the decoder families we serve; each family module says which
architectural switches it turns on. Both the classic (``rope_theta`` + ``rope_scaling``) and
the transformers-5 (``rope_parameters``) spellings of the rotary settings are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10_000.0
    kind: str = "default"  # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Multimodal RoPE (Qwen3-VL): frequencies per axis (temporal, height, width), interleaved;
    # empty for a text-only model. Positions are then (3, b, L); equal axes give plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # YaRN (gpt-oss): the ramp between interpolated and extrapolated frequencies, and the
    # factor cos/sin are scaled by (None: derived from ``factor`` as transformers does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class VisionConfig:
    """What an image-text model adds to its text decoder: how images become tokens.

    ``raw_json`` is the checkpoint's ``vision_config`` as written (the vision tower is built from it).
    An image of ``grid_h x grid_w`` patches becomes ``grid_h * grid_w / merge_size**2`` copies of
    ``image_token_id`` in the token sequence.
    """

    image_token_id: int
    vision_start_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    raw_json: str = "{}"  # vision_config, as JSON (keeps this dataclass hashable)
    # Which transformers vision encoder the checkpoint's tower is (see tinsmith.models.vision.TOWERS).
    tower: str = "qwen3_vl"


@dataclass(frozen=True)
class MoeConfig:
    """Routed-expert settings, named as in transformers' ``Qwen3MoeConfig``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt-oss: router with a bias and a softmax over the top-k logits only; experts with biases
    # and the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``.
    router_bias: bool = False
    softmax_after_topk: bool = False
    router_name: str = "gate"  # the router's module name in checkpoints ("router" in gpt-oss)
    expert_bias: bool = False
    activation: str = "silu"  # "silu" | "clamped_swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Qwen3.5-MoE: a dense shared expert beside the routed ones, scaled by sigmoid(gate(x)) (0: none).
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet layers (Qwen3.5's ``linear_attention`` layers), named as in its config.json."""

    conv_kernel: int  # linear_conv_kernel_dim: the short causal conv over q/k/v
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads (each q/k head serves several value heads)
    key_head_dim: int
    value_head_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the convolved q/k/v projection."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    moe: MoeConfig | None = None  # routed experts (Qwen3-MoE); None for dense families
    vision: VisionConfig | None = None  # None: a text-only model (image chunks are refused)
    images_off: str | None = None  # why an image-text checkpoint is served without its images (None: it is not)
    text_prefix: str = "model."  # where the checkpoint keeps the decoder ("model.language_model." in VL models)
    attention_out_bias: bool = False  # o_proj bias (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit in every softmax denominator (gpt-oss)
    sliding_window: int | None = None  # keys a query sees in a "sliding_attention" layer, itself included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; empty: all full
    norm_scale_in_fp32: bool = False  # RMSNorm weight applied before the cast back (gpt-oss)
    # Qwen3.5: RMSNorm scales by (1 + weight) in fp32; attention has a sigmoid output gate (q_proj
    # doubles its width), rotates only the first ``partial_rotary_factor`` of each head, and the
    # layers that ``layer_types`` marks "linear_attention" are Gated DeltaNet layers.
    norm_offset: bool = False
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    linear_attn: LinearAttnConfig | None = None

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head rotary embeddings turn."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` mixes tokens by Gated DeltaNet (no KV cache) rather than attention."""
        return self.linear_attn is not None and self.layer_types[layer_idx] == "linear_attention"

    @property
    def has_recurrent_state(self) -> bool:
        """True for hybrid models: sampling keeps a fixed-size state per row, and a prompt prefix
        cannot be reused from its key/value entries alone."""
        return self.linear_attn is not None and "linear_attention" in self.layer_types

    @property
    def supports_prefix_cache(self) -> bool:
        """Whether a sampler may reuse a cached prompt prefix: not on hybrid models, whose
        recurrent state after the prefix is not kept (K/V entries alone cannot restore it)."""
        return not self.has_recurrent_state

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: full causal attention)."""
        if self.sliding_window is None or layer_idx >= len(self.layer_types):
            return None
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` routes to experts (transformers' rule for Qwen3-MoE)."""
        m = self.moe
        return (m is not None and m.num_experts > 0 and layer_idx not in m.mlp_only_layers
                and (layer_idx + 1) % m.decoder_sparse_step == 0)

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        """Feed-forward matmul parameters of one layer (only the routed top-k experts when ``active``)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size
        assert self.moe is not None
        m = self.moe
        experts = m.num_experts_per_tok if active else m.num_experts
        matmuls = experts * 3 * h * m.moe_intermediate_size + m.num_experts * h  # experts + router
        if m.shared_expert_intermediate_size:
            matmuls += 3 * h * m.shared_expert_intermediate_size + h  # shared expert and its gate
        if active:
            return matmuls
        biases = (m.num_experts * (2 * m.moe_intermediate_size + h) if m.expert_bias else 0) + \
            (m.num_experts if m.router_bias else 0)
        return matmuls + biases

    def _mixer_matmul_params(self, layer_idx: int) -> int:
        """Matmul parameters of one layer's attention or Gated DeltaNet projections."""
        h = self.hidden_size
        if self.is_linear_layer(layer_idx):
            la = self.linear_attn
            assert la is not None
            value = la.num_value_heads * la.value_head_dim
            return h * (la.conv_dim + value + 2 * la.num_value_heads) + value * h
        q = h * self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        return q + kv + o

    def _mixer_other_params(self, layer_idx: int) -> int:
        """One layer's mixer parameters outside its matmuls (biases, norms, sinks, conv, decay)."""
        if self.is_linear_layer(layer_idx):
            la = self.linear_attn
            assert la is not None
            return la.conv_dim * la.conv_kernel + 2 * la.num_value_heads + la.value_head_dim
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        bias += (self.hidden_size if self.attention_out_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        return bias + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def num_params(self) -> int:
        """Parameter count of the base model (embedding counted once when tied)."""
        h, v = self.hidden_size, self.vocab_size
        layers = sum(self._mixer_matmul_params(i) + self._mixer_other_params(i) + 2 * h
                     + self._mlp_params(i, active=False) for i in range(self.num_layers))
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return layers + embed + h

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in one token's matmuls (everything but embedding lookup and norms;
        for a mixture of experts, only the experts a token is routed to).

        This is the N of the usual ``2 * N * tokens`` forward FLOP estimate.
        """
        layers = sum(self._mixer_matmul_params(i) + self._mlp_params(i, active=True) for i in range(self.num_layers))
        return layers + self.vocab_size * self.hidden_size


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "linear", "yarn"):
        from tinsmith.errors import InvalidInputError

        raise InvalidInputError(f"rope type {kind!r} in config.json is not supported (default, linear, llama3, yarn)")
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        mrope_section=tuple(int(x) for x in params.get("mrope_section") or ()),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _moe_from_hf(raw: dict[str, Any]) -> MoeConfig:
    from tinsmith.errors import InvalidInputError

    try:
        moe = MoeConfig(
            # transformers >= 5.2x writes ``num_local_experts``; hub checkpoints say ``num_experts``.
            num_experts=int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )
    except KeyError as e:
        raise InvalidInputError(f"config.json of a mixture-of-experts model lacks {e.args[0]!r}") from e
    if not 0 < moe.num_experts_per_tok <= moe.num_experts or moe.decoder_sparse_step < 1:
        raise InvalidInputError(
            f"config.json: num_experts_per_tok ({moe.num_experts_per_tok}) must be in 1..num_experts "
            f"({moe.num_experts}) and decoder_sparse_step ({moe.decoder_sparse_step}) at least 1")
    return moe


def config_from_hf(raw: dict[str, Any], family: str, *, attention_bias: bool, qk_norm: bool,
                   moe: bool = False) -> ModelConfig:
    """Build a ModelConfig from a parsed ``config.json`` for a known family."""
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    return ModelConfig(
        architecture=(raw.get("architectures") or ["?"])[0],
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", attention_bias)),
        qk_norm=qk_norm,
        rope=_rope_from_hf(raw),
        eos_token_ids=eos_ids,
        hidden_act=str(raw.get("hidden_act", "silu")),
        moe=_moe_from_hf(raw) if moe else None,
    )
