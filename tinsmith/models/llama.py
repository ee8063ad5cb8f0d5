"""Llama 3 (and 3.1/3.2/3.3): plain decoder; long-context rope scaling comes from config.json."""

from tinsmith.models.registry import Family, register

LLAMA = register(Family(name="llama", architectures=("LlamaForCausalLM",), attention_bias=False, qk_norm=False))
