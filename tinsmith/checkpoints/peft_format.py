"""LoRA adapters on disk in the PEFT layout (``adapter_config.json`` + ``adapter_model.safetensors``).

Sampler weights are written this way so users can take them away and load them with ``peft``
onto the Hugging Face base model. Writes are atomic: files go to a temporary directory that is
renamed into place, with a SHA-256 of the weights recorded and checked on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinsmith.checkpoints.age_encryption import encrypt_files
from tinsmith.errors import InvalidInputError
from tinsmith.models.gated_deltanet import LINEAR_TARGETS
from tinsmith.models.loading import checkpoint_name
from tinsmith.models.moe import split_expert_tensors, stack_expert_tensors
from tinsmith.types import LoraSpec

PEFT_PREFIX = "base_model.model."
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# What vLLM's LoRA serves on Qwen3/Llama-style models: the attention and MLP projections (it
# packs q/k/v and gate/up itself); lm_head and embed_tokens adapters are refused by default.
VLLM_LORA_TARGETS = ATTN + MLP
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
SIDECAR = "tinsmith_adapter.json"  # our extras (seed, switches, checksum); peft ignores the file


HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# Families whose transformers experts are fused parameters that peft adapts as ``target_parameters``.
FUSED_EXPERT_FAMILIES = ("gpt_oss", "qwen3_5_moe")  # Gated DeltaNet layers: their projections are attention targets


def _targets(spec: LoraSpec, family: str | None = None) -> list[str]:
    attn = ATTN + (LINEAR_TARGETS if family in HYBRID_FAMILIES else ())
    return [*(attn if spec.train_attn else ()), *(MLP if spec.train_mlp else ()),
            *(("lm_head",) if spec.train_unembed else ())]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling of ``final``; pass it to :func:`commit_dir` when complete.

    mkdtemp makes it 0700 whatever the umask; it gets the mode a plain mkdir would give, so the
    committed directory follows the process's umask (private under the server's, the user's own
    for ``tinsmith export``)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    tmp.chmod(0o777 & ~_current_umask())
    return tmp


def _current_umask() -> int:
    """The process's umask, read without changing it (setting it to read it back would open a
    window in which another thread's files get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o077  # cannot tell: assume private


def commit_dir(tmp: Path, final: Path) -> None:
    """Replace ``final`` with ``tmp`` (rename is atomic; an old copy is removed after)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:  # put the previous checkpoint back rather than leave the name empty
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def seal_and_commit(tmp: Path, final: Path, age_recipients: Sequence[Any] = ()) -> int:
    """Encrypt ``tmp``'s files to ``age_recipients`` (when any), commit it as ``final``;
    returns the bytes committed."""
    if age_recipients:
        encrypt_files(tmp, age_recipients)
    size = sum(f.stat().st_size for f in tmp.iterdir())
    commit_dir(tmp, final)
    return size


_OLD_COPY = re.compile(r"^\.(.+)\.old-\d+$")  # what commit_dir names the previous copy


def recover_interrupted_commits(root: Path) -> tuple[int, int]:
    """Undo what a crash in the middle of :func:`commit_dir` left under ``root``.

    A crash between its two renames leaves the name empty and the previous copy under
    ``.NAME.old-PID``: that copy goes back (the new one was never acknowledged, so the old one
    is what clients were last told exists). Half-written ``.NAME.XXXX`` temporaries of saves
    that never committed, and old copies whose replacement did land, are removed. Run at
    start-up, before any save. Returns (restored, removed).
    """
    restored = removed = 0
    if not root.is_dir():
        return 0, 0
    for parent, dirs, _ in os.walk(root):
        for d in list(dirs):
            if not d.startswith("."):
                continue
            path = Path(parent) / d
            dirs.remove(d)  # never descend into temporaries
            old = _OLD_COPY.match(d)  # exactly ".NAME.old-PID"; a temporary ends in mkdtemp's suffix
            if old and not (Path(parent) / old.group(1)).exists():
                os.replace(path, Path(parent) / old.group(1))
                restored += 1
            else:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    return restored, removed


# An image-text checkpoint nests its decoder one level down; our module names never do.
_NESTED_DECODER = "model.language_model."


def _our_name(name: str) -> str:
    return "model." + name.removeprefix(_NESTED_DECODER) if name.startswith(_NESTED_DECODER) else name


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The tensor bytes :func:`save_peft_adapter` writes for ``tensors`` (float32), known before
    writing so a storage quota can refuse the save up front; the small JSON files come on top."""
    return sum(t.numel() * 4 for t in tensors.values())


def save_peft_adapter(directory: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor], base_model: str,
                      age_recipients: Sequence[Any] = (), text_prefix: str = "model.",
                      family: str | None = None) -> int:
    """Write ``tensors`` (our names: ``model.layers.0.self_attn.q_proj.lora_A.weight``). Returns bytes written.

    Routed experts' stacked adapters are written one per expert
    (``model.layers.0.mlp.experts.3.gate_proj.lora_A.weight``), the per-expert layout of the hub
    checkpoints, which peft converts onto transformers 5's fused expert parameters when loading.
    ``text_prefix`` is where the base checkpoint keeps its decoder (``model.language_model.`` in
    an image-text model), so the adapter's names are the ones PEFT finds in the HF model class.

    gpt-oss (``family="gpt_oss"``) has no per-expert modules: its expert adapters are written
    as peft's ``target_parameters`` adapters of the fused expert parameters instead. So is
    Qwen3.5-MoE's (peft converts per-expert adapters only for the model types transformers maps
    to its qwen2_moe conversion), with gate and up as the halves of ``gate_up_proj``.

    With ``age_recipients`` every file is age-encrypted to them (``NAME.age``) before the
    directory is committed, so no plaintext copy ever sits under the checkpoint's name.
    """
    tmp = atomic_dir(directory)
    fused = family in FUSED_EXPERT_FAMILIES
    interleaved = family == "gpt_oss"  # gate/up alternate in gpt-oss's gate_up_proj; halves in Qwen3.5-MoE's
    try:
        if fused:
            from tinsmith.models import gpt_oss as gpt_oss_family

            on_disk = gpt_oss_family.to_peft_tensors(tensors, interleaved)
        else:
            on_disk = split_expert_tensors(tensors)
        save_file({PEFT_PREFIX + checkpoint_name(k, text_prefix): v.detach().float().contiguous().cpu()
                   for k, v in on_disk.items()},
                  str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": _targets(spec, family),
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }
        if fused:
            # Routed experts are parameters; a shared expert's gate/up/down stay module targets.
            config["target_modules"] = [t for t in config["target_modules"] if t not in MLP or family != "gpt_oss"]
            if spec.train_mlp:
                config.update(gpt_oss_family.peft_expert_config(spec.rank, spec.alpha))
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        (tmp / SIDECAR).write_text(json.dumps({
            "seed": spec.seed, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed, "sha256": sha256_file(tmp / WEIGHTS),
            **({"fused_gate_up": "interleaved" if interleaved else "halves"} if fused else {})}, indent=2))
        return seal_and_commit(tmp, directory, age_recipients)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_peft_adapter(directory: Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """Read an adapter written by :func:`save_peft_adapter` (or any PEFT LoRA on our targets)."""
    cfg_path, w_path = directory / CONFIG, directory / WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise InvalidInputError(f"no LoRA adapter at {str(directory)!r}")
    cfg = json.loads(cfg_path.read_text())
    extra = json.loads((directory / SIDECAR).read_text()) if (directory / SIDECAR).is_file() else {}
    if extra.get("sha256") and extra["sha256"] != sha256_file(w_path):
        raise InvalidInputError(f"adapter weights at {str(directory)!r} fail their checksum (corrupted)")
    targets = set(cfg.get("target_modules") or [])
    expert_parameters = bool(cfg.get("target_parameters"))  # gpt-oss: adapters of the fused experts
    spec = LoraSpec(
        rank=int(cfg["r"]), seed=extra.get("seed"), alpha=float(cfg.get("lora_alpha", 32)),
        train_attn=bool(targets & set(ATTN + LINEAR_TARGETS)), train_mlp=bool(targets & set(MLP)) or expert_parameters,
        train_unembed="lm_head" in targets,
    )
    raw = {_our_name(k.removeprefix(PEFT_PREFIX)): v for k, v in load_file(str(w_path)).items()}
    if expert_parameters:
        from tinsmith.models.gpt_oss import from_peft_tensors

        interleaved = extra.get("fused_gate_up", "interleaved") == "interleaved"
        tensors = from_peft_tensors(raw, spec.rank, interleaved=interleaved)
    else:
        tensors = stack_expert_tensors(raw)
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise InvalidInputError(f"adapter tensor {name!r} at {str(directory)!r} contains NaN or infinity")
    return spec, tensors
