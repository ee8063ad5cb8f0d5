"""Qwen2 / Qwen2.5: Llama-style decoder with a bias on the q, k and v projections."""

from tinsmith.models.registry import Family, register

QWEN2 = register(Family(name="qwen2", architectures=("Qwen2ForCausalLM",), attention_bias=True, qk_norm=False))
