"""Training-state checkpoints (``save_state``): weights plus optimizer state, enough to resume exactly.

Layout of ``tinker://RUN/weights/NAME`` on disk::

    meta.json               format version, base model, LoRA config (or full), optimizer steps,
                            optimizer config (absent in older checkpoints: AdamW), SHA-256 of every file
    weights.safetensors     trainable tensors under their PEFT-style names
    optimizer.safetensors   per tensor: AdamW's NAME.exp_avg, NAME.exp_avg_sq, NAME.step;
                            Dimuon's NAME.momentum

For LoRA runs the weights are also written as a PEFT adapter (``adapter_config.json`` +
``adapter_model.safetensors``) so the same directory is usable outside tinsmith. The directory
is written under a temporary name and renamed into place, so a crash mid-save never leaves a
checkpoint that loads wrong; checksums are verified on load.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tinsmith.checkpoints.peft_format import CONFIG, PEFT_PREFIX, WEIGHTS, _targets, atomic_dir, commit_dir, sha256_file
from tinsmith.errors import InvalidInputError
from tinsmith.optim import normalize_optimizer_config
from tinsmith.optim import optimizer_type as family_of
from tinsmith.types import LoraSpec

FORMAT = "tinsmith-training-state/1"
META = "meta.json"


@dataclass
class TrainingState:
    base_model: str
    lora: LoraSpec | None  # None: full fine-tune
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None
    steps: int
    optimizer_config: dict = field(default_factory=lambda: {"type": "adamw"})

    @property
    def optimizer_type(self) -> str:
        return family_of(self.optimizer_config)


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise InvalidInputError(f"no training state at {str(directory)!r}")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{META} in {str(directory)!r} is corrupted (not valid JSON: {e})") from None
    if not isinstance(meta, dict):
        raise InvalidInputError(f"{META} in {str(directory)!r} is corrupted (not a JSON object)")
    if meta.get("format") != FORMAT:
        raise InvalidInputError(f"{str(directory)!r} holds format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def optimizer_config_from_meta(meta: dict) -> dict:
    """The optimizer the checkpointed run was created with (checkpoints before the choice: AdamW)."""
    return normalize_optimizer_config(meta.get("optimizer"), field=f"{META} optimizer")


def lora_from_meta(meta: dict) -> LoraSpec | None:
    lora = meta.get("lora")
    return None if lora is None else LoraSpec(**lora)


def training_state_bytes(state: TrainingState) -> int:
    """The tensor bytes :func:`save_training_state` writes for ``state`` (weights, optimizer
    moments, and for LoRA runs the float32 PEFT copy), known before writing so a storage quota
    can refuse the save up front; the small JSON files come on top."""
    weights = sum(t.numel() * t.element_size() for t in state.weights.values())
    optimizer = sum(t.numel() * t.element_size() for t in (state.optimizer or {}).values())
    peft = sum(t.numel() * 4 for t in state.weights.values()) if state.lora is not None else 0
    return weights + optimizer + peft


def save_training_state(directory: Path, state: TrainingState) -> int:
    """Write atomically; returns the bytes written."""
    tmp = atomic_dir(Path(directory))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.weights.items()}, str(tmp / "weights.safetensors"),
                  metadata={"format": "pt"})
        files = ["weights.safetensors"]
        if state.optimizer is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in state.optimizer.items()},
                      str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
            files.append("optimizer.safetensors")
        if state.lora is not None:
            spec = state.lora
            save_file({PEFT_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in state.weights.items()},
                      str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / CONFIG).write_text(json.dumps({
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": state.base_model,
                "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
                "target_modules": _targets(spec), "inference_mode": True,
            }, indent=2))
        meta = {
            "format": FORMAT,
            "base_model": state.base_model,
            "lora": None if state.lora is None else state.lora.__dict__,
            "steps": state.steps,
            "optimizer": state.optimizer_config,
            "sha256": {f: sha256_file(tmp / f) for f in files},
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        commit_dir(tmp, Path(directory))
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_training_state(directory: Path, with_optimizer: bool) -> TrainingState:
    directory = Path(directory)
    meta = read_meta(directory)
    for fname, digest in meta.get("sha256", {}).items():
        if not (directory / fname).is_file() or sha256_file(directory / fname) != digest:
            raise InvalidInputError(f"checkpoint file {fname!r} in {str(directory)!r} is missing or corrupted")
    weights = load_file(str(directory / "weights.safetensors"))
    for name, t in weights.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidInputError(f"checkpoint tensor {name!r} contains NaN or infinity")
    optimizer = None
    if with_optimizer:
        if not (directory / "optimizer.safetensors").is_file():
            raise InvalidInputError(f"checkpoint {str(directory)!r} holds no optimizer state")
        optimizer = load_file(str(directory / "optimizer.safetensors"))
    return TrainingState(meta["base_model"], lora_from_meta(meta), weights, optimizer, int(meta.get("steps", 0)),
                         optimizer_config_from_meta(meta))
