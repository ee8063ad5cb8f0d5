"""A transformers + peft model carrying the same LoRA weights as one of the runtime's adapters.

transformers + peft is the plain path every tinsmith training shortcut (packed rows, grouped
multi-tenant products, fused nodes and kernels, chunked logprobs) must agree with: tests compare
one step's logprobs and gradients against it, and ``bench/gpu/curves.py`` a whole SFT run's loss
curve. Both need the twin to start from the adapter's very weights.
"""

from __future__ import annotations

import torch

from tinsmith.types import LoraSpec

_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]


def target_modules(spec: LoraSpec) -> list[str]:
    """peft's ``target_modules`` for the projections ``spec`` adapts."""
    return (_ATTN if spec.train_attn else []) + (_MLP if spec.train_mlp else []) + (
        ["lm_head"] if spec.train_unembed else [])


def twin_name(peft_name: str) -> str:
    """A peft parameter's name as the runtime's adapter names it."""
    return peft_name.replace("base_model.model.", "").replace(".default", "")


def peft_twin(model_dir, spec: LoraSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu"):
    """transformers' model of ``model_dir`` in ``dtype`` on ``device`` with peft LoRA on the
    projections ``spec`` names, each LoRA tensor copied from ``weights`` (the runtime adapter's
    tensors by name: ``Trainable.named_stepped`` or a snapshot of it). peft keeps the LoRA tensors
    in fp32 whatever the base's dtype, as the runtime's masters are."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=target_modules(spec), lora_dropout=0.0)
    twin = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                p.copy_(weights[twin_name(name)])
    return twin
