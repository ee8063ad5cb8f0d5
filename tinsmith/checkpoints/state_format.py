"""Training-state checkpoints (``save_state``): weights plus optimizer state, enough to resume exactly.

Layout of ``tinker://RUN/weights/NAME`` on disk::

    meta.json               format version, base model, LoRA config (or full), optimizer steps,
                            optimizer config (absent in older checkpoints: AdamW), SHA-256 of every file
    weights.safetensors     trainable tensors under their PEFT-style names
    optimizer.safetensors   per tensor: AdamW's NAME.exp_avg, NAME.exp_avg_sq, NAME.step;
                            Dimuon's NAME.momentum

A full fine-tune sharded over several data-parallel ranks is written by all of them at once
(format ``tinsmith-training-state/2``): each rank writes the tensors it owns to
``weights-0000R-of-0000M.safetensors`` / ``optimizer-0000R-of-0000M.safetensors`` and
``meta.json`` lists them under ``files`` (``{"weights": [...], "optimizer": [...]}``); every
tensor is in exactly one file. Format 1 (one file each, no ``files``) is what one process
writes; the loader reads both.

For LoRA runs the weights are also written as a PEFT adapter (``adapter_config.json`` +
``adapter_model.safetensors``) so the same directory is usable outside tinsmith. The directory
is written under a temporary name and renamed into place, so a crash mid-save never leaves a
checkpoint that loads wrong; checksums are verified on load.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tinsmith.checkpoints.stored_tensors import StoredTensors

from tinsmith.checkpoints.peft_format import CONFIG, PEFT_PREFIX, WEIGHTS, _targets, atomic_dir, commit_dir, sha256_file
from tinsmith.errors import InvalidInputError
from tinsmith.optim import normalize_optimizer_config
from tinsmith.optim import optimizer_type as family_of
from tinsmith.types import LoraSpec

FORMAT = "tinsmith-training-state/1"  # one weights and one optimizer file
SHARDED_FORMAT = "tinsmith-training-state/2"  # several of each, listed in meta.json's "files"
FORMATS = (FORMAT, SHARDED_FORMAT)
META = "meta.json"
WEIGHTS_FILE, OPTIMIZER_FILE = "weights.safetensors", "optimizer.safetensors"


@dataclass
class TrainingState:
    base_model: str
    lora: LoraSpec | None  # None: full fine-tune
    weights: Mapping[str, torch.Tensor]  # a dict, or StoredTensors (read from the files when asked)
    optimizer: Mapping[str, torch.Tensor] | None
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
    if meta.get("format") not in FORMATS:
        raise InvalidInputError(f"{str(directory)!r} holds format {meta.get('format')!r}, expected one of "
                                f"{', '.join(FORMATS)}")
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


def state_header(base_model: str, lora: LoraSpec | None, steps: int, optimizer_config: dict) -> dict:
    """The fields of ``meta.json`` that describe the run (the rest lists the files)."""
    return {"base_model": base_model, "lora": None if lora is None else lora.__dict__, "steps": steps,
            "optimizer": optimizer_config}


def part_files(rank: int, world: int) -> tuple[str, str]:
    """The weights and optimizer files data-parallel rank ``rank`` of ``world`` writes."""
    return (f"weights-{rank + 1:05d}-of-{world:05d}.safetensors",
            f"optimizer-{rank + 1:05d}-of-{world:05d}.safetensors")


def write_state_part(tmp: Path, rank: int, world: int, weights: dict[str, torch.Tensor],
                     optimizer: dict[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """One rank's share of a sharded checkpoint, into the checkpoint's temporary directory.
    Returns ``{file: (kind, sha256)}`` for the files written (a rank that owns no tensor of a
    kind writes no file of it); hashing here spreads it over the ranks."""
    out = {}
    for kind, fname, tensors in zip(("weights", "optimizer"), part_files(rank, world), (weights, optimizer)):
        if tensors:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / fname),
                      metadata={"format": "pt"})
            out[fname] = (kind, sha256_file(tmp / fname))
    return out


def commit_sharded_state(tmp: Path, directory: Path, header: dict, parts: dict[str, tuple[str, str]]) -> int:
    """Write ``meta.json`` over every rank's files (``parts``, as :func:`write_state_part`
    returns them, merged) and commit the directory; returns the bytes committed."""
    files = {kind: sorted(f for f, (k, _) in parts.items() if k == kind) for kind in ("weights", "optimizer")}
    meta = {"format": SHARDED_FORMAT, **header, "files": files,
            "sha256": {f: digest for f, (_, digest) in sorted(parts.items())}}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    size = sum(f.stat().st_size for f in tmp.iterdir())
    commit_dir(tmp, Path(directory))
    return size


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
        meta = {"format": FORMAT, **state_header(state.base_model, state.lora, state.steps, state.optimizer_config),
                "sha256": {f: sha256_file(tmp / f) for f in files}}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        commit_dir(tmp, Path(directory))
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_training_state(directory: Path, with_optimizer: bool, stored: bool = False) -> TrainingState:
    """A checkpoint's state, its files' checksums and its weights' values checked. ``stored``: its
    tensors stay in the files (:class:`~tinsmith.checkpoints.stored_tensors.StoredTensors`, read
    when asked, one at a time) rather than all read into host memory now."""
    directory = Path(directory)
    meta = read_meta(directory)
    for fname, digest in meta.get("sha256", {}).items():
        if not (directory / fname).is_file() or sha256_file(directory / fname) != digest:
            raise InvalidInputError(f"checkpoint file {fname!r} in {str(directory)!r} is missing or corrupted")
    listed = meta.get("files") or {"weights": [WEIGHTS_FILE], "optimizer": [OPTIMIZER_FILE]}
    weights = _load_files(directory, listed.get("weights") or [], stored)
    for name in weights:  # one tensor at a time when stored
        t = weights[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidInputError(f"checkpoint tensor {name!r} contains NaN or infinity")
    optimizer = None
    if with_optimizer:
        names = listed.get("optimizer") or []
        if not names or not all((directory / f).is_file() for f in names):
            raise InvalidInputError(f"checkpoint {str(directory)!r} holds no optimizer state")
        optimizer = _load_files(directory, names, stored)
    return TrainingState(meta["base_model"], lora_from_meta(meta), weights, optimizer, int(meta.get("steps", 0)),
                         optimizer_config_from_meta(meta))


def _load_files(directory: Path, names: list[str], stored: bool = False) -> Mapping[str, torch.Tensor]:
    """The tensors of ``names`` merged (a sharded checkpoint's parts; a tensor in two is refused),
    read now, or left in the files (``stored``)."""
    if stored:
        return StoredTensors([directory / f for f in names], str(directory))
    out: dict[str, torch.Tensor] = {}
    for fname in names:
        part = load_file(str(directory / fname))
        twice = out.keys() & part.keys()
        if twice:
            raise InvalidInputError(f"checkpoint {str(directory)!r} holds {sorted(twice)[0]!r} in more than one file")
        out.update(part)
    return out
