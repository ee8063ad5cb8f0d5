"""Merge a LoRA checkpoint into its base model and write a plain Hugging Face model directory.

``W' = W + (alpha / r) * B @ A`` for every adapted projection. When the adapter trains the
unembedding of a model with tied embeddings, the merged ``lm_head`` is written separately and
the config is untied, since the input embedding must stay the base one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tinsmith.checkpoints.peft_format import CONFIG, atomic_dir, load_peft_adapter, seal_and_commit
from tinsmith.checkpoints.state_format import META, load_training_state
from tinsmith.errors import InvalidInputError
from tinsmith.models.loading import load_model, resolve_model_dir

_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def read_adapter(checkpoint_dir: Path):
    """(LoraSpec, tensors, base model name) from a training state or a PEFT adapter directory."""
    if (checkpoint_dir / META).is_file():
        st = load_training_state(checkpoint_dir, with_optimizer=False)
        if st.lora is None:
            raise InvalidInputError(f"{str(checkpoint_dir)!r} is a full fine-tune state, not a LoRA adapter")
        return st.lora, st.weights, st.base_model
    if (checkpoint_dir / CONFIG).is_file():
        spec, tensors = load_peft_adapter(checkpoint_dir)
        base = json.loads((checkpoint_dir / CONFIG).read_text()).get("base_model_name_or_path")
        return spec, tensors, base
    raise InvalidInputError(f"no LoRA checkpoint in {str(checkpoint_dir)!r}")


def hf_model_bytes(weights: dict[str, torch.Tensor]) -> int:
    """The tensor bytes :func:`save_hf_model` writes (known up front, for the storage quota)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def save_hf_model(directory: Path, weights: dict[str, torch.Tensor], base_dir: Path,
                  age_recipients: Sequence[Any] = ()) -> int:
    """Write a full fine-tune as a plain Hugging Face model directory (``model.safetensors`` plus
    the base model's config and tokenizer files), atomically, age-encrypted when recipients are
    given. ``weights`` use the Hugging Face names; a tied unembedding appears once, as the
    embedding, which is what the copied config (``tie_word_embeddings``) expects."""
    tmp = atomic_dir(Path(directory))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        for f in _COPY:
            if (Path(base_dir) / f).is_file():
                shutil.copy(Path(base_dir) / f, tmp / f)
        return seal_and_commit(tmp, Path(directory), age_recipients)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_merged(checkpoint_dir: Path, out_dir: Path, base_model: str | None = None) -> Path:
    spec, tensors, recorded_base = read_adapter(Path(checkpoint_dir))
    base = base_model or recorded_base
    if not base:
        raise InvalidInputError("the checkpoint does not name its base model; pass --base-model")
    base_dir = resolve_model_dir(base)
    loaded = load_model(str(base_dir), device="cpu", dtype=torch.float32)
    if loaded.config.vision is not None:
        raise InvalidInputError(f"merged export of image-text base model {base!r} is not supported yet; "
                                "export the LoRA adapter instead")
    model = loaded.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tie = loaded.config.tie_word_embeddings
    untie = tie and spec.train_unembed
    for name, layer in model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed):
        A, B = tensors[f"{name}.lora_A.weight"].float(), tensors[f"{name}.lora_B.weight"].float()
        state[f"{name}.weight"] = layer.weight.float() + (spec.alpha / spec.rank) * (B @ A)
    if tie and not untie:
        state.pop("lm_head.weight", None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in _COPY:
        if (base_dir / f).is_file():
            shutil.copy(base_dir / f, out_dir / f)
    if untie:
        cfg = json.loads((out_dir / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
