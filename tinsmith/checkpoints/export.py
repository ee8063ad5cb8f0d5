"""``tinsmith export``: a LoRA checkpoint in a form other tools load.

* ``merged``: the adapter merged into its base model, ``W' = W + (alpha / r) * B @ A`` for
  every adapted projection, written like a Hugging Face release: the base model's dtype (its
  config's ``dtype``/``torch_dtype``), safetensors shards with an index. When the adapter
  trains the unembedding of a model with tied embeddings, the merged ``lm_head`` is written
  separately and the config is untied, since the input embedding must stay the base one.
* ``peft``: the adapter as trained (``peft.PeftModel.from_pretrained`` loads it).
* ``peft-vllm``: the adapter restricted to the modules vLLM's LoRA serves (attention and MLP
  projections); an ``lm_head`` LoRA is dropped, with a warning, since the result then differs
  from the trained model.

Every export goes to a fresh directory (refused when ``--out`` is not empty) with a short
``README.md`` saying which format it is and how to load it, and can be pushed to the Hugging
Face Hub (:mod:`tinsmith.checkpoints.hub`).
"""

from __future__ import annotations

import json
import shutil
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinsmith.checkpoints.hf_shards import DEFAULT_MAX_SHARD_SIZE, INDEX, shard_size, write_shards
from tinsmith.checkpoints.peft_format import (CONFIG, VLLM_LORA_TARGETS, atomic_dir, commit_dir, load_peft_adapter,
                                              save_peft_adapter, seal_and_commit)
from tinsmith.checkpoints.state_format import META, load_training_state
from tinsmith.errors import InvalidInputError
from tinsmith.models.loading import UNTRAINED_PREFIXES, checkpoint_name, read_config, resolve_model_dir, weight_files
from tinsmith.models.moe import split_expert_tensors
from tinsmith.types import LoraSpec

FORMATS = ("merged", "peft", "peft-vllm")
# The base model's files an export carries beside its weights (an image-text model's processor
# configs too: without them the export is no model its class can run on images).
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
         "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


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


def hf_model_bytes(weights: dict[str, torch.Tensor], base_dir: Path) -> int:
    """The tensor bytes :func:`save_hf_model` writes (known up front, for the storage quota)."""
    return sum(t.numel() * t.element_size() for t in weights.values()) + untrained_bytes(base_dir)


def _hf_layout(weights: dict[str, torch.Tensor], base_dir: Path) -> dict[str, torch.Tensor]:
    """``weights`` as the base checkpoint stores them: the family's layout (gpt-oss: fused
    experts; others: one tensor per expert) under the checkpoint's names (an image-text model's
    decoder under ``model.language_model.``), so that its own class loads the export."""
    cfg = read_config(base_dir)
    if cfg.family == "gpt_oss":
        from tinsmith.models.gpt_oss import to_hf_weights

        laid_out = to_hf_weights(weights)
    else:
        laid_out = split_expert_tensors(weights)
    return {checkpoint_name(k, cfg.text_prefix): v for k, v in laid_out.items()}


def _untrained_by_file(base_dir: Path) -> dict[Path, list[str]]:
    """The base checkpoint's tensors that a full fine-tune leaves as they are (an image-text
    model's vision tower, multi-token-prediction weights; see :data:`UNTRAINED_PREFIXES`), by file."""
    by_file: dict[Path, list[str]] = {}
    for n, f in weight_files(Path(base_dir)).items():
        if n.startswith(UNTRAINED_PREFIXES):
            by_file.setdefault(f, []).append(n)
    return by_file


def untrained_bytes(base_dir: Path) -> int:
    """The bytes of :func:`_untrained_by_file`'s tensors, from the files' headers (nothing is read)."""
    total = 0
    for f, names in _untrained_by_file(base_dir).items():
        with safe_open(str(f), framework="pt") as fh:
            for n in names:
                s = fh.get_slice(n)
                elements = 1
                for d in s.get_shape():
                    elements *= d
                total += elements * _ST_ITEM_BYTES[s.get_dtype()]
    return total


def _untrained_tensors(base_dir: Path) -> dict[str, torch.Tensor]:
    """:func:`_untrained_by_file`'s tensors, read from the base checkpoint: an export of a full
    fine-tune carries them unchanged, so it is a whole checkpoint of the base model's class."""
    out: dict[str, torch.Tensor] = {}
    for f, names in _untrained_by_file(base_dir).items():
        with safe_open(str(f), framework="pt") as fh:
            out.update({n: fh.get_tensor(n) for n in names})
    return out


def save_hf_model(directory: Path, weights: dict[str, torch.Tensor], base_dir: Path,
                  age_recipients: Sequence[Any] = ()) -> int:
    """Write a full fine-tune as a plain Hugging Face model directory (``model.safetensors`` plus
    the base model's config and tokenizer files), atomically, age-encrypted when recipients are
    given. ``weights`` use the Hugging Face names; a tied unembedding appears once, as the
    embedding, which is what the copied config (``tie_word_embeddings``) expects. Stacked expert
    weights are written one tensor per expert, as hub checkpoints are (gpt-oss: fused, unquantised,
    as transformers saves it). The decoder is named as the base checkpoint names it, and the base's
    tensors that are never trained (an image-text model's vision tower, multi-token-prediction
    weights) are copied, so the base model's own class loads the export whole."""
    tmp = atomic_dir(Path(directory))
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in _hf_layout(weights, Path(base_dir)).items()}
        save_file({**tensors, **_untrained_tensors(Path(base_dir))}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        copy_base_files(tmp, Path(base_dir), written=tensors)
        return seal_and_commit(tmp, Path(directory), age_recipients)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_part_file(rank: int, world: int) -> str:
    """The shard of a Hugging Face model directory that data-parallel rank ``rank`` writes."""
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def write_hf_part(tmp: Path, rank: int, world: int, weights: dict[str, torch.Tensor],
                  base_dir: Path) -> dict[str, list[tuple[str, int, int]]]:
    """One rank's shard of a sharded Hugging Face export (its own tensors, in the family's
    layout; rank 0's also the base's untrained tensors, as :func:`save_hf_model` writes them).
    Returns ``{file: [(name, elements, bytes)]}``, what the index needs (nothing when the rank
    owns no tensor)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in _hf_layout(weights, Path(base_dir)).items()}
    if rank == 0:
        tensors.update(_untrained_tensors(Path(base_dir)))
    if not tensors:
        return {}
    fname = hf_part_file(rank, world)
    save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
    return {fname: [(k, v.numel(), v.numel() * v.element_size()) for k, v in tensors.items()]}


def commit_hf_parts(tmp: Path, directory: Path, parts: dict[str, list[tuple[str, int, int]]], base_dir: Path,
                    age_recipients: Sequence[Any] = ()) -> int:
    """Finish a sharded Hugging Face export whose shards every rank wrote into ``tmp``: the
    index ``transformers`` reads (``model.safetensors.index.json``), the base model's config and
    tokenizer files; then seal and commit it. Returns the bytes committed."""
    entries = [(name, n, size, fname) for fname, rows in parts.items() for name, n, size in rows]
    index = {"metadata": {"total_parameters": sum(n for _, n, _, _ in entries),
                          "total_size": sum(size for _, _, size, _ in entries)},
             "weight_map": {name: fname for name, _, _, fname in entries}}
    (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    copy_base_files(tmp, Path(base_dir), written=index["weight_map"])
    return seal_and_commit(tmp, Path(directory), age_recipients)


def copy_base_files(tmp: Path, base_dir: Path, written: Collection[str], untie: bool = False) -> None:
    """The base model's config, generation config, tokenizer and processor files beside an
    export whose tensors are ``written`` (their names). The config says what the tensors are:
    without ``quantization_config`` when the base's experts are MXFP4 (``*_blocks``) and the
    export's are not (they are written unquantised), and untied when ``untie`` (a merged
    ``lm_head`` written apart from the embedding)."""
    for f in _COPY:
        if (base_dir / f).is_file():
            shutil.copy(base_dir / f, tmp / f)
    dequantised = any(n.endswith("_blocks") for n in weight_files(base_dir)) and not any(
        n.endswith("_blocks") for n in written)
    if untie or dequantised:
        cfg = json.loads((tmp / "config.json").read_text())
        if untie:
            cfg["tie_word_embeddings"] = False
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"]["tie_word_embeddings"] = False
        if dequantised:
            cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))


# safetensors' dtype names (``safe_open(...).get_slice(name).get_dtype()``)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_ITEM_BYTES = {**{k: v.itemsize for k, v in _ST_DTYPES.items()}, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4,
                  "U64": 8}


@dataclass
class ExportResult:
    """Where the export went, which kind of export it is (``summary``, one line for the user)
    and what they must know about it (``warnings``)."""

    path: Path
    files: list[str]
    summary: str
    warnings: list[str] = field(default_factory=list)


def config_dtype(raw: dict[str, Any]) -> torch.dtype | None:
    """The floating dtype a Hugging Face ``config.json`` declares (``dtype``, or the older
    ``torch_dtype``; a multimodal config's ``text_config`` too); None when it names none."""
    for cfg in (raw, raw.get("text_config") or {}):
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(name, str):
            dt = getattr(torch, name.removeprefix("torch."), None)
            if isinstance(dt, torch.dtype) and dt.is_floating_point:
                return dt
    return None


def _save_order(name: str) -> list[tuple]:
    """The order ``transformers`` (5.x) writes a state dict in, so shards hold the same tensors:
    dot-separated parts, numbers numerically (``layers.2`` before ``layers.10``), names
    alphabetically, a trailing number of a name numerically (``shard_2`` before ``shard_11``)."""
    key = []
    for part in name.split("."):
        text = part.rstrip("0123456789")
        if part.isdigit():
            key.append((0, int(part)))
        elif text != part:
            key.append((1, text, int(part[len(text):])))
        else:
            key.append((1, part))
    return key


def _require_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidInputError(f"--out {str(out_dir)!r} exists and is not empty; choose a new directory")


def _lora_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A, B) of every adapted module."""
    pairs = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            b = tensors.get(f"{module}.lora_B.weight")
            if b is None:
                raise InvalidInputError(f"adapter has {key!r} but no matching lora_B")
            pairs[module] = (a, b)
    if not pairs:
        raise InvalidInputError("the adapter holds no LoRA weights")
    return pairs


def _merge_plan(base_dir: Path, spec: LoraSpec, tensors: dict[str, torch.Tensor]):
    """(meta plan of the merged model, function making each tensor, untie?) without loading it."""
    raw = json.loads((base_dir / "config.json").read_text())
    cfg = read_config(base_dir)
    tie = cfg.tie_word_embeddings
    files = weight_files(base_dir)
    out_dtype = config_dtype(raw)
    scale = spec.alpha / spec.rank
    fused: dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
    if cfg.family == "gpt_oss" and any(".mlp.experts." in k for k in tensors):
        fused = _gpt_oss_merged_experts(cfg, files, tensors, scale, out_dtype)
        tensors = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    # routed experts: one pair per expert; modules named as the checkpoint names them (an
    # image-text model's decoder under model.language_model.)
    pairs = {checkpoint_name(m, cfg.text_prefix): ab
             for m, ab in (_lora_pairs(split_expert_tensors(tensors)) if tensors else {}).items()}
    if not pairs and not fused:
        raise InvalidInputError("the adapter holds no LoRA weights")
    untie = tie and "lm_head" in pairs
    sources = {name: name for name in files if not _replaced_by(name, fused)}  # output -> base tensor it starts from
    if tie:
        sources.pop("lm_head.weight", None)  # tied: the embedding alone is written
        if untie:
            sources["lm_head.weight"] = checkpoint_name("model.embed_tokens.weight", cfg.text_prefix)
    for module in pairs:
        if f"{module}.weight" not in sources:
            raise InvalidInputError(f"the adapter adapts {module!r}, which base model {str(base_dir)!r} lacks")
    plan: dict[str, torch.Tensor] = {name: meta for name, (meta, _) in fused.items()}
    for name in sources:
        with safe_open(files[sources[name]], framework="pt") as fh:
            sl = fh.get_slice(sources[name])
            shape, stored = sl.get_shape(), _ST_DTYPES.get(sl.get_dtype())
        if stored is None:
            raise InvalidInputError(f"tensor {name!r} has an unsupported dtype {sl.get_dtype()}")
        dtype = out_dtype if out_dtype is not None and stored.is_floating_point else stored
        plan[name] = torch.empty(shape, dtype=dtype, device="meta")
    plan = {name: plan[name] for name in sorted(plan, key=_save_order)}

    def make(name: str) -> torch.Tensor:
        if name in fused:
            return fused[name][1]()
        with safe_open(files[sources[name]], framework="pt", device="cpu") as fh:
            t = fh.get_tensor(sources[name])
        module = name.removesuffix(".weight")
        if module in pairs:
            a, b = pairs[module]
            delta = scale * (b.float() @ a.float())
            if delta.shape != t.shape:
                raise InvalidInputError(f"the adapter's {module!r} is {tuple(delta.shape)}, "
                                        f"the base weight {tuple(t.shape)}")
            t = t.float() + delta
            if not bool(torch.isfinite(t).all()):
                raise InvalidInputError(f"merging {module!r} gives NaN or infinite values")
        return t.to(plan[name].dtype)

    return plan, make, untie


def _replaced_by(name: str, fused: dict[str, Any]) -> bool:
    """Whether base tensor ``name`` is one of the fused experts rewritten in :data:`fused`
    (plain, or its MXFP4 ``_blocks`` / ``_scales``)."""
    return name.removesuffix("_blocks").removesuffix("_scales") in fused


def _gpt_oss_merged_experts(cfg, files: dict[str, Path], tensors: dict[str, torch.Tensor], scale: float,
                            out_dtype: torch.dtype | None) -> dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
    """gpt-oss's fused experts with the adapter merged: ``gate_up_proj`` (experts x in x 2I, gate
    and up interleaved) and ``down_proj`` (experts x I x out), unquantised, for every layer (a
    layer the adapter does not reach is dequantised too, so the checkpoint has one layout and
    needs no ``quantization_config``). Name -> (meta tensor, maker)."""
    from tinsmith.models.gpt_oss import expert_weight_sources

    dtype = out_dtype or torch.float32
    prefixes = sorted({n.split(".mlp.experts.")[0] + ".mlp.experts" for n in files if ".mlp.experts." in n})

    def ours(prefix: str, proj: str) -> torch.Tensor:
        """One projection's stacked weight (experts x out x in) with its adapter merged, fp32."""
        recipe = expert_weight_sources(f"{prefix}.{proj}.weight", cfg, files)
        if recipe is None:
            raise InvalidInputError(f"base model lacks the experts of {prefix!r}")
        names, build = recipe
        read = []
        for n in names:
            with safe_open(files[n], framework="pt", device="cpu") as fh:
                read.append(fh.get_tensor(n))
        w = build(read).float()
        a, b = tensors.get(f"{prefix}.{proj}.lora_A.weight"), tensors.get(f"{prefix}.{proj}.lora_B.weight")
        if a is not None and b is not None:
            if a.shape[0] != w.shape[0] or b.shape[1] != w.shape[1] or a.shape[2] != w.shape[2]:
                raise InvalidInputError(f"the adapter's {prefix}.{proj} is experts x {tuple(b.shape[1:2])} x "
                                        f"{tuple(a.shape[2:])}, the base weight {tuple(w.shape)}")
            w = w + scale * torch.bmm(b.float(), a.float())
            if not bool(torch.isfinite(w).all()):
                raise InvalidInputError(f"merging {prefix}.{proj} gives NaN or infinite values")
        return w

    def gate_up(prefix: str) -> torch.Tensor:
        gate, up = ours(prefix, "gate_proj"), ours(prefix, "up_proj")  # (E, I, H)
        both = gate.new_empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        both[:, 0::2], both[:, 1::2] = gate, up
        return both.transpose(1, 2).contiguous().to(dtype)

    def down(prefix: str) -> torch.Tensor:
        return ours(prefix, "down_proj").transpose(1, 2).contiguous().to(dtype)  # (E, I, H)

    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size
    out: dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
    for prefix in prefixes:
        out[f"{prefix}.gate_up_proj"] = (torch.empty(e, h, 2 * i, dtype=dtype, device="meta"),
                                         lambda p=prefix: gate_up(p))
        out[f"{prefix}.down_proj"] = (torch.empty(e, i, h, dtype=dtype, device="meta"), lambda p=prefix: down(p))
    return out


def export_merged(checkpoint_dir: Path, out_dir: Path, base_model: str | None = None,
                  max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, show_progress: bool = False) -> ExportResult:
    """Merge the adapter into its base model and write a Hugging Face model directory (atomically:
    a failed export leaves nothing under ``out_dir``)."""
    out_dir = Path(out_dir)
    _require_empty(out_dir)
    shard_size(max_shard_size)
    spec, tensors, recorded_base = read_adapter(Path(checkpoint_dir))
    base = base_model or recorded_base
    if not base:
        raise InvalidInputError("the checkpoint does not name its base model; pass --base-model")
    base_dir = resolve_model_dir(base)
    plan, make, untie = _merge_plan(base_dir, spec, tensors)
    tmp = atomic_dir(out_dir)
    try:
        copy_base_files(tmp, base_dir, written=plan, untie=untie)
        written = write_shards(tmp, plan, make, max_shard_size, show_progress)
        dtype = str(next(iter(plan.values())).dtype).removeprefix("torch.")
        (tmp / "README.md").write_text(_model_card("merged", base, dtype))
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shards = len([f for f in written if f.endswith(".safetensors")])
    layout = "one model.safetensors" if shards == 1 else f"{shards} safetensors shards with an index"
    summary = f"merged model ({dtype}, {layout}): loads in transformers and vLLM like the base model"
    return ExportResult(out_dir, sorted(p.name for p in out_dir.iterdir()), summary)


def vllm_servable(spec: LoraSpec, tensors: dict[str, torch.Tensor]
                  ) -> tuple[LoraSpec, dict[str, torch.Tensor], list[str]]:
    """(spec, tensors, dropped modules) of the adapter restricted to :data:`VLLM_LORA_TARGETS`."""
    pairs = _lora_pairs(tensors)
    keep = {m for m in pairs if m.rsplit(".", 1)[-1] in VLLM_LORA_TARGETS}
    dropped = sorted(set(pairs) - keep)
    if not keep:
        raise InvalidInputError("the adapter adapts only modules vLLM's LoRA cannot serve "
                                f"({', '.join(dropped)}); export it with --format merged instead")
    kept = {k: v for k, v in tensors.items() if k.rsplit(".lora_", 1)[0] in keep}
    return replace(spec, train_unembed=False), kept, dropped


def _family_of(base: str) -> str | None:
    """The model family of ``base`` when its config.json can be found locally (it decides the
    PEFT layout of expert adapters), else None (the per-expert layout)."""
    try:
        return read_config(resolve_model_dir(base)).family
    except Exception:
        return None


def export_adapter(checkpoint_dir: Path, out_dir: Path, base_model: str | None = None,
                   vllm: bool = False) -> ExportResult:
    """Write the adapter as a PEFT directory; with ``vllm`` only the modules vLLM serves."""
    out_dir = Path(out_dir)
    _require_empty(out_dir)
    spec, tensors, recorded_base = read_adapter(Path(checkpoint_dir))
    base = base_model or recorded_base or ""
    warnings = []
    if vllm:
        spec, tensors, dropped = vllm_servable(spec, tensors)
        if dropped:
            warnings.append(
                f"the adapter trained {', '.join(dropped)}, which vLLM's LoRA does not serve: the vLLM adapter "
                "leaves it out, so it is NOT the trained model (by an amount that depends on the training; "
                "compare outputs, or serve --format merged, which keeps every trained weight)")
    save_peft_adapter(out_dir, spec, tensors, base, family=_family_of(base))
    (out_dir / "README.md").write_text(_model_card("peft-vllm" if vllm else "peft", base, "float32", warnings))
    modules = sorted({m.rsplit(".", 1)[-1] for m in _lora_pairs(tensors)})
    if vllm:
        summary = f"vLLM-servable PEFT adapter ({', '.join(modules)}): vllm serve --enable-lora, or peft"
    elif "lm_head" in modules:
        summary = (f"PEFT adapter as trained ({', '.join(modules)}): loads in peft; vLLM refuses its lm_head, "
                   "use --format peft-vllm or merged for vLLM")
    else:
        summary = f"PEFT adapter as trained ({', '.join(modules)}): loads in peft, and vLLM serves it"
    return ExportResult(out_dir, sorted(p.name for p in out_dir.iterdir()), summary, warnings)


_HOW_TO_LOAD = {
    "merged": ("transformers", "The LoRA adapter merged into the base model's weights ({dtype}), "
               "a plain Hugging Face model:\n\n```python\nfrom transformers import AutoModelForCausalLM\n"
               "model = AutoModelForCausalLM.from_pretrained(PATH_OR_REPO, dtype=\"auto\")\n```\n\n"
               "vLLM serves it as any model: `vllm serve PATH_OR_REPO`.\n"),
    "peft": ("peft", "A PEFT LoRA adapter, every trained module included (also the unembedding when it was "
             "trained, which vLLM cannot serve: use the `peft-vllm` export for vLLM):\n\n```python\n"
             "from peft import PeftModel\nmodel = PeftModel.from_pretrained(base_model, PATH_OR_REPO)\n```\n"),
    "peft-vllm": ("peft", "A PEFT LoRA adapter restricted to the attention and MLP projections, the modules "
                  "vLLM's LoRA serves:\n\n```\nvllm serve BASE_MODEL --enable-lora "
                  "--lora-modules adapter=PATH_OR_REPO\n```\n\nIt also loads with "
                  "`peft.PeftModel.from_pretrained`.\n"),
}


def _model_card(fmt: str, base: str, dtype: str, warnings: Sequence[str] = ()) -> str:
    """A short README.md: which export this is and how to load it (the Hub shows it)."""
    library, how = _HOW_TO_LOAD[fmt]
    hub_id = base if re.fullmatch(r"[\w.-]+/[\w.-]+", base or "") and not Path(base).exists() else None
    front = ["---", f"library_name: {library}", "tags:", "- tinsmith", "- lora"]
    if hub_id:
        front.append(f"base_model: {hub_id}")
    front.append("---")
    notes = "".join(f"\n**Warning:** {w}\n" for w in warnings)
    return ("\n".join(front) + f"\n\n# tinsmith export ({fmt})\n\nBase model: `{base}`.\n\n"
            + how.format(dtype=dtype) + notes)


def run_export(checkpoint_dir: Path, out_dir: Path, fmt: str = "merged", base_model: str | None = None,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, push_to_hub: str | None = None,
               private: bool = False, show_progress: bool = False) -> ExportResult:
    """What ``tinsmith export`` does once the checkpoint's directory is known: write ``fmt`` to
    ``out_dir``, then push it when asked (the local copy stays)."""
    if fmt not in FORMATS:
        raise InvalidInputError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "merged":
        result = export_merged(checkpoint_dir, out_dir, base_model, max_shard_size, show_progress)
    else:
        result = export_adapter(checkpoint_dir, out_dir, base_model, vllm=fmt == "peft-vllm")
    if push_to_hub:
        from tinsmith.checkpoints.hub import push_folder

        push_folder(result.path, push_to_hub, private, show_progress)
    return result
