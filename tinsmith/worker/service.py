"""The worker: every base model this server holds, and every training run placed on one.

It is the only object that touches torch. The engine calls it from a single dedicated thread,
so its methods need no locking. Training runs are addressed by their public ``model_id``; the
worker maps each to (base model, trainable unit).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinsmith.errors import CapacityError, InvalidInputError, StateLostError, TinsmithError
from tinsmith.models.config import ModelConfig
from tinsmith.models.loading import LoadedModel, load_model
from tinsmith.models.lora import pack_weights
from tinsmith.types import AdamParams, ForwardBackwardInput, ForwardBackwardResult, LoraSpec
from tinsmith.sampling.sampler import Sampler
from tinsmith.worker.runtime import FULL_UNIT, TrainingRuntime, TrainRequest
from tinsmith.worker.trainables import detach_lora, install_lora_weights, lora_tensors

log = logging.getLogger(__name__)


@dataclass
class RuntimeOptions:
    device: str = "cpu"
    max_lora_adapters: int = 16
    max_lora_rank: int = 128
    max_training_runs: int = 256
    micro_batch_tokens: int | None = None  # None: automatic (see auto_micro_batch_tokens)
    micro_batch_seqs: int = 1 << 30
    gradient_checkpointing: bool = False
    max_full_finetunes: int = 1
    max_sampler_snapshots: int = 64
    max_sampling_rows: int = 256


@dataclass
class BaseModel:
    """One served base model: its public name, weights, and the shared LoRA runtime."""

    name: str
    source: str
    loaded: LoadedModel
    lora: TrainingRuntime
    full: dict[str, TrainingRuntime] = field(default_factory=dict)  # model_id -> private copy

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config


@dataclass
class Snapshot:
    """Frozen adapter weights that samplers read: never changed by later training."""

    key: str
    base: BaseModel
    slot: int
    spec: LoraSpec
    reloadable: bool  # stored on disk, so it can be evicted and loaded again
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Placement:
    base: BaseModel
    runtime: TrainingRuntime
    unit: int
    is_lora: bool
    lora: LoraSpec | None


class Worker:
    def __init__(self, options: RuntimeOptions):
        self.options = options
        self.bases: dict[str, BaseModel] = {}
        self.aliases: dict[str, str] = {}
        self.placements: dict[str, Placement] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.samplers: dict[str, Sampler] = {}
        self._snapshot_slots = itertools.count(1_000_000)  # never collides with training slots

    # ----------------------------------------------------------------------------- base models
    def add_base_model(self, name: str, source: str | None = None) -> BaseModel:
        """Load ``source`` (dir or HF id) and serve it under ``name``."""
        o = self.options
        loaded = load_model(source or name, device=o.device)
        rt = TrainingRuntime(
            loaded.model, max_lora_adapters=o.max_lora_adapters, max_lora_rank=o.max_lora_rank,
            max_training_runs=o.max_training_runs,
            micro_batch_tokens=o.micro_batch_tokens or auto_micro_batch_tokens(loaded.config, loaded.model, o), micro_batch_seqs=o.micro_batch_seqs,
            gradient_checkpointing=o.gradient_checkpointing,
        )
        base = BaseModel(name=name, source=source or name, loaded=loaded, lora=rt)
        self.bases[name] = base
        log.info("serving %s from %s (%s, %.1fM params)", name, loaded.model_dir, loaded.config.family,
                 loaded.config.num_params / 1e6)
        return base

    def add_alias(self, alias: str, name: str) -> None:
        self.aliases[alias] = name

    def resolve_base(self, name: str) -> BaseModel:
        """The base model a client's ``base_model`` string refers to (aliases and ``:peft:<ctx>`` suffixes allowed)."""
        for candidate in (name, name.split(":peft:")[0]):
            key = self.aliases.get(candidate, candidate)
            if key in self.bases:
                return self.bases[key]
        served = ", ".join(sorted(set(self.bases) | set(self.aliases)))
        raise InvalidInputError(f"base_model {name!r} is not served here; served models: {served}")

    # ----------------------------------------------------------------------------- training runs
    def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> Placement:
        if model_id in self.placements:  # replayed create: keep the existing run
            return self.placements[model_id]
        base = self.resolve_base(base_model)
        if lora is not None:
            unit = base.lora.create_adapter(lora)
            placement = Placement(base, base.lora, unit, True, lora)
        else:
            if sum(len(b.full) for b in self.bases.values()) >= self.options.max_full_finetunes:
                raise CapacityError(
                    f"this server holds at most {self.options.max_full_finetunes} full fine-tuning runs "
                    "(--max-full-finetunes); use a LoRA config or unload one"
                )
            model = copy.deepcopy(base.loaded.model)
            if model.config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
            pack_weights(model)  # a deep copy does not keep the packed views linked
            rt = TrainingRuntime(model, full_finetune=True,
                                 micro_batch_tokens=base.lora.micro_batch_tokens,
                                 micro_batch_seqs=self.options.micro_batch_seqs,
                                 gradient_checkpointing=self.options.gradient_checkpointing)
            base.full[model_id] = rt
            placement = Placement(base, rt, FULL_UNIT, False, None)
        self.placements[model_id] = placement
        return placement

    def placement(self, model_id: str) -> Placement:
        try:
            return self.placements[model_id]
        except KeyError:
            raise StateLostError(
                f"model {model_id!r} has no state on this server (it was unloaded, or the server restarted "
                "before it was saved); create it again or load it from a checkpoint"
            ) from None

    def unload_model(self, model_id: str) -> None:
        p = self.placements.pop(model_id, None)
        if p is None:
            return
        if p.is_lora:
            p.runtime.delete_adapter(p.unit)
        else:
            p.base.full.pop(model_id, None)

    # ----------------------------------------------------------------------------- work
    def forward_backward(self, batch: list[tuple[str, ForwardBackwardInput]]) -> list[ForwardBackwardResult | TinsmithError]:
        """Run many runs' forward/backward requests; requests sharing a runtime go in one call."""
        results: list[ForwardBackwardResult | TinsmithError | None] = [None] * len(batch)
        groups: dict[int, tuple[TrainingRuntime, list[int]]] = {}
        for i, (model_id, inp) in enumerate(batch):
            try:
                p = self.placement(model_id)
            except TinsmithError as e:
                results[i] = e
                continue
            groups.setdefault(id(p.runtime), (p.runtime, []))[1].append(i)
        for rt, idxs in groups.values():
            reqs = [TrainRequest(self.placements[batch[i][0]].unit, batch[i][1]) for i in idxs]
            for i, res in zip(idxs, rt.forward_backward(reqs)):
                results[i] = res
        return results  # type: ignore[return-value]

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        p = self.placement(model_id)
        return p.runtime.optim_step(p.unit, params)

    # ----------------------------------------------------------------------------- checkpoints
    def export_training_state(self, model_id: str):
        from tinsmith.checkpoints.state_format import TrainingState

        p = self.placement(model_id)
        tr = p.runtime.unit(p.unit)
        weights, opt = tr.export_state()
        return TrainingState(p.base.name, p.lora, weights, opt, tr.steps)

    def load_training_state(self, model_id: str, base_model: str, state, create: bool) -> None:
        """Create the run from ``state`` (create=True) or replace an existing run's state."""
        if create:
            if model_id in self.placements:
                self.unload_model(model_id)
            self.create_model(model_id, base_model, state.lora)
        p = self.placement(model_id)
        if (p.lora is None) != (state.lora is None) or (p.lora and state.lora and (
                p.lora.rank != state.lora.rank or
                (p.lora.train_attn, p.lora.train_mlp, p.lora.train_unembed)
                != (state.lora.train_attn, state.lora.train_mlp, state.lora.train_unembed))):
            raise InvalidInputError(f"the checkpoint's LoRA configuration does not match model {model_id!r}")
        try:
            tr = p.runtime.unit(p.unit)
            tr.import_state(state.weights, state.optimizer)
            tr.steps = state.steps if state.optimizer is not None else 0
        except Exception:
            if create:
                self.unload_model(model_id)
            raise

    # ----------------------------------------------------------------------------- sampling
    def sampler(self, base: BaseModel) -> Sampler:
        if base.name not in self.samplers:
            self.samplers[base.name] = Sampler(base.loaded.model, _tokenizer_decoder(base.loaded.model_dir),
                                               max_rows=self.options.max_sampling_rows)
        return self.samplers[base.name]

    def adapter_weights(self, model_id: str) -> tuple[LoraSpec, dict[str, torch.Tensor], BaseModel]:
        p = self.placement(model_id)
        if not p.is_lora:
            raise InvalidInputError(f"model {model_id!r} is a full fine-tune; only LoRA runs can be sampled or exported as adapters")
        return p.lora, lora_tensors(p.runtime.unit(p.unit)), p.base

    def snapshot(self, model_id: str, key: str, reloadable: bool = False) -> Snapshot:
        """Freeze the run's current adapter under ``key`` (a sampler id or a tinker path)."""
        spec, tensors, base = self.adapter_weights(model_id)
        return self._install_snapshot(key, base, spec, tensors, reloadable)

    def load_snapshot(self, key: str, base_model: str, directory: Path) -> Snapshot:
        from tinsmith.checkpoints.peft_format import load_peft_adapter

        if key in self.snapshots:
            return self.use_snapshot(key)
        spec, tensors = load_peft_adapter(directory)
        return self._install_snapshot(key, self.resolve_base(base_model), spec, tensors, reloadable=True)

    def use_snapshot(self, key: str) -> Snapshot:
        snap = self.snapshots[key]
        snap.last_used = time.monotonic()
        return snap

    def _install_snapshot(self, key: str, base: BaseModel, spec: LoraSpec, tensors, reloadable: bool) -> Snapshot:
        old = self.snapshots.pop(key, None)
        slot = next(self._snapshot_slots)
        install_lora_weights(base.loaded.model, slot, spec, tensors)
        if old is not None:
            self._drop_snapshot(old)
        snap = Snapshot(key, base, slot, spec, reloadable)
        self.snapshots[key] = snap
        self._evict_snapshots()
        return snap

    def _drop_snapshot(self, snap: Snapshot) -> None:
        detach_lora(snap.base.loaded.model, snap.slot)

    def _evict_snapshots(self) -> None:
        """Keep at most ``max_sampler_snapshots``: drop the least recently used ones not in use."""
        excess = len(self.snapshots) - self.options.max_sampler_snapshots
        if excess <= 0:
            return
        busy = {s for sampler in self.samplers.values() for s in sampler.slots_in_use()}
        for snap in sorted(self.snapshots.values(), key=lambda s: s.last_used):
            if excess <= 0:
                break
            if snap.slot in busy:
                continue
            del self.snapshots[snap.key]
            self._drop_snapshot(snap)
            excess -= 1



def _tokenizer_decoder(model_dir: Path):
    """token ids -> text, for stop strings (the fast tokenizer file when present)."""
    tj = Path(model_dir) / "tokenizer.json"
    if tj.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tj))
        return lambda ids: tok.decode(ids, skip_special_tokens=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda ids: hf.decode(ids, skip_special_tokens=False)


def auto_micro_batch_tokens(cfg: ModelConfig, model, o: RuntimeOptions) -> int:
    """Padded tokens per training micro-batch when none is configured.

    On CPU, 2048: measured on the tiny models, larger batches fall out of cache (16384 ran ~12%
    slower per token than 4096, and 4096 ~12% slower than 2048 when four tenants' 8 x 128 steps
    share one call, while 32 x 512 ran alike at 1024-4096). On a GPU, as many as half the free memory holds, at a rough
    activation cost per token (about 20 hidden-sized values per layer kept for backward, a few
    with checkpointing, plus the fp32 logits row), within [1024, 65536].
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 2048
    free, _ = torch.cuda.mem_get_info(device)
    width = 2 if next(model.parameters()).dtype in (torch.bfloat16, torch.float16) else 4
    per_layer = (4 if o.gradient_checkpointing else 20) * cfg.hidden_size * width
    per_token = cfg.num_layers * per_layer + 8 * cfg.vocab_size
    return int(min(65536, max(1024, 0.5 * free / per_token)))
