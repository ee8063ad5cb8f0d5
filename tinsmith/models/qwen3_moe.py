"""Qwen3-MoE: the Qwen3 decoder (q/k norm, no QKV bias) with top-k routed experts in its MLPs.

The experts and router live in :mod:`tinsmith.models.moe`; ``mlp_only_layers`` and
``decoder_sparse_step`` in config.json say which layers route (transformers' rule).
"""

from tinsmith.models.registry import Family, register

QWEN3_MOE = register(Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), attention_bias=False,
                            qk_norm=True, moe=True))
