"""Load Hugging Face checkpoints: a local directory, the local HF cache, or the hub when online.

Weights come from safetensors (single file or sharded with ``model.safetensors.index.json``).
The model is built on the meta device and the tensors are assigned in place, so memory is
touched once; every tensor is checked for shape and finiteness before the model is returned.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinsmith.errors import InvalidInputError, NotFoundError
from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import CausalLM, Rotary
from tinsmith.models.lora import pack_weights
from tinsmith.models.moe import expert_tensor_sources
from tinsmith.models.registry import family_for, family_named
from tinsmith.models.vision import VisionTower
from tinsmith.progress import bar, progress_wanted

log = logging.getLogger(__name__)

_HUB_PATTERNS = ["config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
                 "*.safetensors", "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.jinja"]


def resolve_model_dir(name_or_path: str) -> Path:
    """Turn a local path or an HF id into a local directory holding ``config.json``.

    Order: an existing local directory; the local HF cache; a hub download unless offline
    (``HF_HUB_OFFLINE=1``). Raises NotFoundError with what was tried.
    """
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise NotFoundError(f"model directory {str(p)!r} has no config.json")
        return p
    if name_or_path.count("/") != 1 or name_or_path.startswith(("/", ".")):
        raise NotFoundError(f"model {name_or_path!r} is neither a local directory nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception as cache_err:  # not cached: try the hub unless offline
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            raise NotFoundError(
                f"model {name_or_path!r} is not a local directory and not in the local Hugging Face cache "
                f"(offline mode, so the hub was not tried): {cache_err}"
            ) from cache_err
        try:
            return Path(snapshot_download(name_or_path, allow_patterns=_HUB_PATTERNS))
        except Exception as hub_err:
            raise NotFoundError(f"model {name_or_path!r} could not be fetched from the hub: {hub_err}") from hub_err


# Where a checkpoint keeps its image processor's settings (transformers reads either).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def read_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of the checkpoint in ``model_dir``. An image-text config over a directory
    without its image processor's settings (a text fine-tune saved without them, say) serves the
    text decoder alone: with no processor, images cannot become tokens."""
    raw = _raw_config(model_dir)
    cfg = family_for(raw).config(raw)
    if cfg.vision is not None and not _has_processor(model_dir):
        cfg = dataclasses.replace(cfg, vision=None, images_off=(
            f"its directory holds no {' or '.join(PROCESSOR_FILES)} (the image processor's settings), so its "
            "vision tower is not loaded"))
    return cfg


def _has_processor(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in PROCESSOR_FILES)


def _raw_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise NotFoundError(f"no safetensors weights in {str(model_dir)!r}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                out[name] = f
    return out


def _single(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact reference checks), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


DTYPE_NAMES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The weights' dtype for a ``--dtype`` value (``auto``: :func:`default_dtype` of the device)."""
    if name == "auto":
        return default_dtype(torch.device(device))
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected auto, {', '.join(DTYPE_NAMES)}") from None


def probe_dtype(dtype: torch.dtype, device: str | torch.device) -> None:
    """Run, on tiny tensors, each kind of op the model and sampler use in ``dtype`` on ``device``.

    Raises whatever torch raises when the pair is unsupported (an old GPU without bf16, a CPU
    build lacking a half-precision kernel), so start-up can refuse it in one line instead of
    the first request failing.
    """
    from torch.nn import functional as F

    dev = torch.device(device)
    x = torch.randn(2, 3, 8, 4, device=dev).to(dtype)
    w = torch.randn(4, 4, device=dev).to(dtype)
    y = torch.addmm(x.reshape(-1, 4), x.reshape(-1, 4), w.t())
    y = F.silu(F.linear(y, w)) * y
    a = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    e = F.embedding(torch.tensor([[0, 1]], device=dev), w)
    n = F.rms_norm(a.float(), (4,), eps=1e-6).to(dtype)
    torch.log_softmax((y.sum() + e.sum() + n.sum()).float().reshape(1, 1).expand(1, 4), dim=-1)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    model_dir: Path
    vision: VisionTower | None = None  # image-text models: processor and frozen vision encoder


def load_model(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               pack: bool = True, on_layer: Callable[[CausalLM, int], None] | None = None) -> LoadedModel:
    """Build the model for a checkpoint and load its weights (frozen, ready for adapters).

    Tensors are read from memory-mapped files, so a tensor whose dtype and device are already
    the ones asked for is not copied until something writes it. ``pack=False`` leaves the
    projections unpacked (no second, private copy of their weights). Weights are loaded one
    decoder layer at a time, then the rest (embedding, final norm, head); ``on_layer(model, i)``
    runs as soon as layer ``i`` holds its weights, before the next is read: a tensor-parallel
    rank cuts its shard of the layer there, so whatever a layer's tensors cost whole (stacked or
    dequantised experts, a dtype conversion) is held for one layer at a time.
    """
    model_dir = resolve_model_dir(name_or_path)
    cfg = read_config(model_dir)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    files = weight_files(model_dir)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    num_experts = cfg.moe.num_experts if cfg.moe else 0
    family_sources = family_named(cfg.family).tensor_sources
    # Each tensor we need, as (checkpoint tensors, combine): a family's own layout first; a
    # multimodal checkpoint nests the decoder (model.language_model.*); stacked experts may come
    # from several tensors.
    recipes: dict[str, tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]] = {}
    missing = []
    for name in expected:
        stored = checkpoint_name(name, cfg.text_prefix)
        if stored not in files and name in files:
            # an image-text config over a decoder stored flat: the full fine-tune exports of
            # earlier versions (sampler weights a server may still hold), readable as they are
            stored = name
        recipe = family_sources(name, cfg, files) if family_sources is not None else None
        if recipe is None:
            recipe = ([stored], _single) if stored in files else (
                expert_tensor_sources(stored, num_experts, files)  # per-expert or fused, where the decoder sits
                or expert_tensor_sources(name, num_experts, files))  # ... or stored flat (see above)
        if recipe is None:
            missing.append(stored)
        else:
            recipes[name] = recipe
    skipped = [n for n in files if n.startswith(UNTRAINED_PREFIXES if cfg.vision is None else ("mtp.",))]
    if skipped:
        why = "serving the text decoder only" if cfg.vision is None else "multi-token prediction is not used"
        if cfg.vision is None and any(n.startswith(VISION_PREFIX) for n in skipped) and not _has_processor(model_dir):
            why += f" (no {' or '.join(PROCESSOR_FILES)} for its images)"
        log.info("%s: %s; %d vision-tower / multi-token-prediction tensors are not loaded (%s...)",
                 model_dir.name, why, len(skipped), skipped[0])
    if missing:
        raise InvalidInputError(f"checkpoint {str(model_dir)!r} lacks tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(source: str) -> torch.Tensor:
            f = files[source]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, framework="pt", device="cpu"))
            return handles[f].get_tensor(source)

        total = sum(expected[name].numel() * expected[name].element_size() for name in recipes)
        loading = stack.enter_context(bar(progress_wanted(), total=total, desc=f"loading {model_dir.name}",
                                          unit="B", unit_scale=True, unit_divisor=1024, leave=False))
        for layer, names in _by_layer(recipes):
            state: dict[str, torch.Tensor] = {}
            for name in names:
                sources, combine = recipes[name]
                t = combine([read(s) for s in sources])
                loading.update(expected[name].numel() * expected[name].element_size())
                _check_tensor(t, sources[0], files[sources[0]], tuple(expected[name].shape))
                state[name] = t.to(device=device, dtype=dtype)
            model.load_state_dict(state, strict=False, assign=True)
            del state
            if layer is not None and on_layer is not None:
                on_layer(model, layer)
    model = _finish(model, device, pack)
    vision = None
    if cfg.vision is not None:
        vision = VisionTower(cfg.vision, model_dir, _vision_weights(files), device, dtype)
    return LoadedModel(model=model, config=cfg, model_dir=model_dir, vision=vision)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _by_layer(names) -> list[tuple[int | None, list[str]]]:
    """``names`` grouped by decoder layer, in layer order, then the rest (layer None)."""
    groups: dict[int | None, list[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        groups.setdefault(int(m.group(1)) if m else None, []).append(name)
    layers = sorted(k for k in groups if k is not None)
    return [(i, groups[i]) for i in layers] + ([(None, groups[None])] if None in groups else [])


def _assemble(model: CausalLM, state: dict[str, torch.Tensor], device: torch.device, pack: bool = True) -> CausalLM:
    """``model`` (built on the meta device) holding ``state``'s tensors (see :func:`_finish`)."""
    model.load_state_dict(state, strict=False, assign=True)
    return _finish(model, device, pack)


def _finish(model: CausalLM, device: torch.device, pack: bool) -> CausalLM:
    """A loaded ``model`` made ready: tied head, rotary tables on ``device``, projections packed
    (unless not ``pack``), frozen, in eval mode."""
    cfg = model.config
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = Rotary(cfg.rotary_dim, cfg.rope, cfg.max_position_embeddings).to(device)
    if pack:
        pack_weights(model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def model_from_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                       dtype: torch.dtype) -> CausalLM:
    """A whole frozen model of ``cfg`` holding ``weights`` (its parameters by name, e.g. a full
    fine-tune's sampler snapshot), copied to ``device`` in ``dtype``. What a process that holds
    only a tensor-parallel shard of the base model builds to sample a whole snapshot."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters())
    missing = [n for n in expected if n not in weights and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise InvalidInputError(f"weights for {cfg.family} lack tensors: {missing[:5]}")
    state = {n: weights[n].to(device=device, dtype=dtype) for n in expected if n in weights}
    return _assemble(model, state, device)


def empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A whole frozen model of ``cfg`` on ``device`` in ``dtype`` whose weights are not yet
    written (packed, rotary tables made): what a process holding only shards of a run fills one
    tensor at a time, in place, without ever holding the weights twice."""
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    return _finish(model, device, pack=True)


VISION_PREFIX = "model.visual."
# What a checkpoint may carry beside the decoder that tinsmith never trains: an image-text model's
# vision tower (frozen), released checkpoints' multi-token-prediction weights.
UNTRAINED_PREFIXES = (VISION_PREFIX, "mtp.")


def checkpoint_name(name: str, text_prefix: str) -> str:
    """Our name of a decoder tensor (``model.layers.0...``) as a checkpoint whose decoder sits under
    ``text_prefix`` stores it (``model.language_model.layers.0...`` in an image-text model)."""
    return text_prefix + name.removeprefix("model.") if name.startswith("model.") else name


def _vision_weights(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """The vision encoder's tensors (``model.visual.*``), named as its module names them."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        if name.startswith(VISION_PREFIX):
            by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt", device="cpu") as fh:
            for name in names:
                out[name.removeprefix(VISION_PREFIX)] = _check_tensor(fh.get_tensor(name), name, f, None)
    if not out:
        raise InvalidInputError(f"image-text checkpoint has no vision tensors ({VISION_PREFIX}*)")
    return out


def _check_tensor(t: torch.Tensor, name: str, f: Path, shape: tuple[int, ...] | None) -> torch.Tensor:
    """``t`` (tensor ``name`` of file ``f``) if it has the shape config.json implies and finite values."""
    if shape is not None and tuple(t.shape) != shape:
        raise InvalidInputError(f"tensor {name!r} has shape {tuple(t.shape)}, config.json implies {shape}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise InvalidInputError(f"tensor {name!r} in {str(f)!r} contains NaN or infinite values")
    return t
