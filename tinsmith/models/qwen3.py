"""Qwen3 (dense): per-head RMSNorm on queries and keys, no QKV bias, explicit head_dim."""

from tinsmith.models.registry import Family, register

QWEN3 = register(Family(name="qwen3", architectures=("Qwen3ForCausalLM",), attention_bias=False, qk_norm=True))
