"""The worker: every base model this server holds, and every training run placed on one.

It is the only object that touches torch. The engine calls it from a single dedicated thread,
so its methods need no locking. Training runs are addressed by their public ``model_id``; the
worker maps each to (base model, trainable unit).

Runs and sampler snapshots carry their owner, an opaque tenant string (the worker knows
nothing of API keys or HTTP), so that what one tenant holds is capped and never taken away to
make room for another tenant's work.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinsmith import device_memory
from tinsmith.errors import CapacityError, InvalidInputError, NotFoundError, StateLostError, TinsmithError
from tinsmith.models.chunked_logprobs import DEFAULT_CHUNK_BYTES
from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import LoadedModel, empty_model, load_model, model_from_weights, resolve_dtype
from tinsmith.models.lora import pack_weights
from tinsmith.optim import ADAMW, normalize_optimizer_config
from tinsmith.types import ForwardBackwardInput, LoraSpec, OptimParams
from tinsmith.sampling.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES
from tinsmith.sampling.sampler import Sampler
from tinsmith.tenants import key_id
from tinsmith.worker.activation_memory import activation_bytes_per_token
from tinsmith.worker.runtime import FULL_UNIT, FbPass, TrainingRuntime, TrainRequest
from tinsmith.worker.trainables import detach_lora, install_lora_weights
from tinsmith.worker.warm_up import configure_device

log = logging.getLogger(__name__)


@dataclass
class RuntimeOptions:
    device: str = "cpu"
    dtype: str = "auto"  # a --dtype value: auto, bfloat16, float16, float32
    device_memory_fraction: float = 1.0  # of each GPU's memory this process may reserve (tinsmith.device_memory)
    max_lora_adapters: int = 16
    max_lora_rank: int = 128
    max_training_runs: int = 256
    micro_batch_tokens: int | None = None  # None: automatic (see auto_micro_batch_tokens)
    chunk_tokens: int | None = None  # tokens per scheduling chunk; None: one micro-batch
    micro_batch_seqs: int = 1 << 30
    gradient_checkpointing: bool = False
    packing: str = "auto"  # a --train-packing value: auto, on, off (see train_packing)
    max_full_finetunes: int = 1
    max_full_sampler_snapshots: int = 4  # frozen whole-model copies held in host memory (full fine-tunes' snapshots)
    resident_full_sampler_snapshots: int = 1  # of those, how many may be on the device at once
    max_snapshot_host_bytes: int | None = None  # host bytes of full snapshots, the whole server (None: no cap)
    max_snapshot_host_bytes_per_key: int | None = None  # host bytes of full snapshots one owner may hold
    max_sampler_snapshots: int = 64
    max_sampling_rows: int = 256
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # per sampler; 0: off
    sampler_kv_cache_bytes: int | None = None  # per sampler; None: see Sampler's ``kv_cache_bytes``
    sampler_cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (on CUDA devices)
    sampler_run_ahead: bool = True  # decode bursts queued before the last one is read (on CUDA devices)
    dependent_launches: bool = True  # Triton kernels launched dependent on the kernel before (tinsmith.kernels.pdl)
    sampler_kv_cache_layout: str = "auto"  # "paged", "rows"; auto: paged on CUDA (see Sampler's ``kv_layout``)
    sampler_prefill_chunk_tokens: int | None = None  # None: see Sampler's ``prefill_chunk_tokens``; 0: whole prompts
    max_runs_per_key: int | None = None  # training runs one owner may hold (None: no per-owner cap)
    max_sampler_snapshots_per_key: int | None = None  # snapshots one owner may hold in memory
    sampler_snapshot_idle_s: float = 120.0  # unused this long (and no request queued/running): idle
    tensor_parallel_size: int = 1  # >1: every base model is sharded over that many ranks (tinsmith.parallel)
    data_parallel_size: int = 1  # >1: every base model is replicated on that many ranks (tinsmith.parallel.replicas)
    ray_address: str | None = None  # the followers are Ray actors on this cluster (None: local processes)
    ray_placement_strategy: str = "STRICT_PACK"

    @property
    def train_packing(self) -> bool:
        """Whether training micro-batches are packed (``--train-packing``); the model still decides
        whether it can be (``CausalLM.supports_packing``). ``auto`` is on: on CUDA packing drops the
        padding's MLP, LoRA and attention work at no cost (varlen attention), and on the CPU the
        mixed-length benchmark measured it a few percent faster, never slower (docs/performance.md)."""
        return self.packing != "off"


@dataclass
class BaseModel:
    """One served base model: its public name, weights, and the shared LoRA runtime."""

    name: str
    source: str
    loaded: LoadedModel
    lora: TrainingRuntime
    full: dict[str, TrainingRuntime] = field(default_factory=dict)  # model_id -> private copy
    tp: Any = None  # in a process group: the TPBase whose ranks hold the shards or replicas (lora is its runtime)

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def image_token_counter(self) -> Callable[[int, int], int] | None:
        """(width, height) -> image tokens, by the model's own processor; None for a text-only model."""
        return None if self.loaded.vision is None else self.loaded.vision.num_tokens

    @functools.cached_property
    def tokenizer(self):
        """The model's own Hugging Face tokenizer (with its chat template), loaded on first use.

        Only text-level endpoints (OpenAI-compatible sampling) need it; token-level ones never do.
        """
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.loaded.model_dir))


@dataclass
class Snapshot:
    """Frozen weights that samplers read: never changed by later training.

    A LoRA snapshot is an adapter ``slot`` of the shared base model (``spec`` set). A full
    fine-tune's snapshot is ``host``: a frozen copy of every weight in host memory (pinned when
    the device is CUDA), taken when it is saved. Its sampler reads ``model``, a device copy
    built from ``host`` only while the snapshot is resident (see :meth:`Worker.make_resident`):
    at most ``resident_full_sampler_snapshots`` are, least recently used offloaded first, so the
    device holds a bounded number of whole-model copies however many snapshots exist.

    Why offload rather than copy-on-write (sharing the live weights until the next optim_step):
    the optimizer updates every weight of a full fine-tune in place at each step, so a
    copy-on-write snapshot becomes a full device copy at the first step after it, unbounded in
    number; the host copy costs one transfer per save and per residency switch instead, and
    device memory stays bounded. (A client that samples between steps without needing a frozen
    copy asks for ``kind="inflight"``, which reads the live weights and copies nothing.)
    """

    key: str
    base: BaseModel
    slot: int | None
    spec: LoraSpec | None
    reloadable: bool  # stored on disk, so it can be evicted and loaded again; otherwise eviction loses it
    owner: str = ""
    last_used: float = field(default_factory=time.monotonic)
    model: CausalLM | None = None  # full snapshots: the device copy while resident
    host: dict[str, torch.Tensor] | None = None  # full snapshots: the frozen weights in host memory
    host_bytes: int = 0

    @property
    def is_full(self) -> bool:
        return self.host is not None

    @property
    def sampler_key(self) -> str:
        return self.base.name if not self.is_full else f"snapshot:{self.key}"


@dataclass
class LiveCopy:
    """The whole live weights of a sharded full fine-tune on rank 0's device, for its inflight
    samplers: gathered from the shards again whenever the run's weights version moved on."""

    model: CausalLM
    version: int | None = None  # the run's weights version it holds (None: not yet gathered)


@dataclass
class Placement:
    base: BaseModel
    runtime: TrainingRuntime
    unit: int
    is_lora: bool
    lora: LoraSpec | None
    owner: str = ""


class Worker:
    def __init__(self, options: RuntimeOptions):
        self.options = options
        self.bases: dict[str, BaseModel] = {}
        self.aliases: dict[str, str] = {}
        self.placements: dict[str, Placement] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.samplers: dict[str, Sampler] = {}
        # Counters of samplers already forgotten (snapshot and live-weights samplers come and go),
        # so the server's totals (/metrics) never go down.
        self.retired_sampler_stats: Counter[str] = Counter()
        # sampling session id -> model_id of the run whose live weights it samples (kind="inflight")
        self.inflight: dict[str, str] = {}
        # model_id -> the whole weights its inflight samplers read, for runs sharded over a group
        self.live_copies: dict[str, LiveCopy] = {}
        self._snapshot_slots = itertools.count(1_000_000)  # never collides with training slots
        self.stats = {"snapshot_evictions": 0, "live_weight_gathers": 0}  # read by metrics scrapes
        self.tp_group = None  # the process group (a DrivenGroup) under tensor or data parallelism

    def close(self) -> None:
        """Release the tensor-parallel ranks, if any (clean shutdown)."""
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None

    def fault(self) -> str | None:
        """Why this worker cannot run work although nothing has failed a request yet (a
        tensor-parallel rank exited), for /healthz; None while it can."""
        return None if self.tp_group is None else self.tp_group.failure

    def _group_option(self) -> tuple[str, int]:
        """The option that made this worker a process group, and its value."""
        o = self.options
        if o.data_parallel_size > 1:
            return "--data-parallel-size", o.data_parallel_size
        return "--tensor-parallel-size", o.tensor_parallel_size

    # ----------------------------------------------------------------------------- base models
    def add_base_model(self, name: str, source: str | None = None) -> BaseModel:
        """Load ``source`` (dir or HF id) and serve it under ``name``."""
        o = self.options
        configure_device(torch.device(o.device), dependent_launches=o.dependent_launches,
                         memory_fraction=o.device_memory_fraction)
        if o.tensor_parallel_size > 1 or o.data_parallel_size > 1:
            return self._add_tp_base_model(name, source)
        loaded = load_model(source or name, device=o.device, dtype=resolve_dtype(o.dtype, o.device))
        rt = training_runtime(loaded, o)
        base = BaseModel(name=name, source=source or name, loaded=loaded, lora=rt)
        rt.busy_slots = lambda: self._sampler_slots(name)
        rt.on_park_busy = lambda slot: self._adapter_parked(name, slot)
        rt.release_memory = self.release_idle_sampler_memory
        self.bases[name] = base
        log.info("serving %s from %s (%s, %.1fM params)", name, loaded.model_dir, loaded.config.family,
                 loaded.config.num_params / 1e6)
        return base

    def _add_tp_base_model(self, name: str, source: str | None) -> BaseModel:
        """A base model served by the process group (started with the first): sharded over the
        tensor-parallel ranks, or replicated on the data-parallel ones."""
        from tinsmith.models.loading import read_config, resolve_model_dir
        from tinsmith.parallel.serving import TPBase, check_servable, runtime_kwargs_of, start_group

        o = self.options
        model_dir = resolve_model_dir(source or name)
        replicas = o.data_parallel_size > 1
        size = o.data_parallel_size * o.tensor_parallel_size
        if o.tensor_parallel_size > 1:
            check_servable(read_config(model_dir), o.tensor_parallel_size, source or name)
        sampler_kwargs = sampler_kwargs_of(o)
        classes: dict = {}
        group_kwargs: dict = {}
        if replicas:
            from tinsmith.parallel.replicas import ReplicaRuntime, ReplicaSampler, replica_rank

            group_kwargs = dict(make_target=functools.partial(replica_rank, o.tensor_parallel_size),
                                option="--data-parallel-size", label="data-parallel")
            classes = dict(runtime_class=ReplicaRuntime, sampler_class=ReplicaSampler)
        if self.tp_group is None:
            self.tp_group = start_group(size, o.device, follower_threads=max(1, torch.get_num_threads() // size),
                                        ray_address=o.ray_address, ray_strategy=o.ray_placement_strategy,
                                        **group_kwargs)
        tpb = TPBase(self.tp_group, name, str(model_dir), resolve_dtype(o.dtype, o.device), runtime_kwargs_of(o),
                     sampler_kwargs, **classes)
        # Rank 0 sizes micro-batches (from its free memory) and every rank uses that size.
        micro = o.micro_batch_tokens or auto_micro_batch_tokens(tpb.loaded.config, tpb.model, o)
        tpb.configure(micro, auto_checkpoint_above(micro, tpb.model, o))
        base = BaseModel(name=name, source=source or name, loaded=tpb.loaded,
                         lora=tpb.runtime, tp=tpb)  # type: ignore[arg-type]  (the runtime's stand-in)
        self.bases[name] = base
        self.samplers[name] = tpb.sampler  # type: ignore[assignment]
        layout = (f"replicated on {o.data_parallel_size} data-parallel ranks" if o.tensor_parallel_size == 1 else
                  f"sharded over {o.tensor_parallel_size} tensor-parallel ranks" if not replicas else
                  f"replicated {o.data_parallel_size} times, each replica sharded over {o.tensor_parallel_size} "
                  f"tensor-parallel ranks ({size} ranks)")
        log.info("serving %s from %s (%s, %.1fM params) %s", name, model_dir, tpb.loaded.config.family,
                 tpb.loaded.config.num_params / 1e6, layout)
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
    def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None, owner: str = "",
                     optimizer_type: str = ADAMW) -> Placement:
        if model_id in self.placements:  # replayed create: keep the existing run
            return self.placements[model_id]
        base = self.resolve_base(base_model)
        self._check_run_cap(owner)
        if lora is not None:
            unit = base.lora.create_adapter(lora, optimizer_type)
            placement = Placement(base, base.lora, unit, True, lora, owner)
        else:
            if sum(len(b.full) for b in self.bases.values()) >= self.options.max_full_finetunes:
                raise CapacityError(
                    f"this server holds at most {self.options.max_full_finetunes} full fine-tuning runs "
                    "(--max-full-finetunes); use a LoRA config or unload one"
                )
            if base.tp is not None:  # a group: every rank holds its FSDP shard of the run
                from tinsmith.parallel.replicas import FullRunHandle

                handle = FullRunHandle(base.tp, model_id, optimizer_type)
                base.full[model_id] = handle.runtime  # type: ignore[assignment]  (the runtime's stand-in)
                self.placements[model_id] = Placement(base, handle.runtime, FULL_UNIT, False, None, owner)  # type: ignore[arg-type]
                return self.placements[model_id]
            model = copy.deepcopy(base.loaded.model)
            if model.config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
            pack_weights(model)  # a deep copy does not keep the packed views linked
            rt = TrainingRuntime(model, full_finetune=True, full_optimizer=optimizer_type,
                                 micro_batch_tokens=base.lora.micro_batch_tokens,
                                 checkpoint_above_tokens=base.lora.checkpoint_above_tokens,
                                 micro_batch_seqs=self.options.micro_batch_seqs,
                                 gradient_checkpointing=self.options.gradient_checkpointing,
                                 vision=base.loaded.vision, packing=base.lora.packing)
            rt.release_memory = self.release_idle_sampler_memory
            base.full[model_id] = rt
            placement = Placement(base, rt, FULL_UNIT, False, None, owner)
        self.placements[model_id] = placement
        return placement

    def _check_run_cap(self, owner: str) -> None:
        """One owner may not hold every run slot: only it can free its runs, so refuse at once."""
        cap = self.options.max_runs_per_key
        if cap is None:
            return
        held = sum(1 for p in self.placements.values() if p.owner == owner)
        if held >= cap:
            log.warning("refused a training run to key %s: it holds %d, the most allowed per key "
                        "(--max-runs-per-key %d)", key_id(owner), held, cap)
            raise CapacityError(
                f"this API key already holds {held} training runs, the most this server allows per key "
                f"(--max-runs-per-key {cap}); close a ServiceClient whose runs are no longer needed (its runs "
                "are unloaded, saved checkpoints stay) and create this run again"
            )

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
            if p.base.tp is not None:
                p.runtime.drop()  # type: ignore[attr-defined]  (every replica's shard)
        for key in [k for k, m in self.inflight.items() if m == model_id]:
            del self.inflight[key]
        self.drop_idle_live_samplers()

    # ----------------------------------------------------------------------------- work
    def fb_begin(self, model_id: str, inputs: list[ForwardBackwardInput]) -> FbPass:
        """Validate one run's forward/backward requests; their datums then run through :meth:`fb_advance`."""
        p = self.placement(model_id)
        return p.runtime.begin([TrainRequest(p.unit, inp) for inp in inputs])

    def fb_advance(self, quotas: list[tuple[FbPass, int]], budget: int,
                   on_done: Callable[[FbPass], None] | None = None) -> None:
        """Run up to each pass's quota of tokens and about ``budget`` in all; passes on one
        runtime share micro-batches. ``on_done`` is called for each pass the moment it completes."""
        by_runtime: dict[int, list[tuple[FbPass, int]]] = {}
        for fb, quota in quotas:
            by_runtime.setdefault(id(fb.runtime), []).append((fb, quota))
        for group in by_runtime.values():
            before = sum(fb.tokens_run for fb, _ in group)
            group[0][0].runtime.advance(group, on_done, budget=max(1, budget))
            budget -= sum(fb.tokens_run for fb, _ in group) - before

    def settle(self) -> None:
        """Wait until the device has run everything queued on it. Kernels run asynchronously on a
        GPU: without this, whatever runs next (a sampling slice) would wait for them itself."""
        device = torch.device(self.options.device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def chunk_tokens(self, keys: int = 1) -> int:
        """Tokens one scheduling chunk runs while ``keys`` API keys have forward/backward work.

        By default one micro-batch (of the largest configured size) when one key has the device
        to itself, half of one when keys share it: another key's small request then waits
        for at most about half a micro-batch, for ~5% of multi-key throughput on a CPU.
        ``--train-chunk-tokens`` fixes the size.
        """
        if self.options.chunk_tokens:
            return self.options.chunk_tokens
        micro_batch = max((b.lora.micro_batch_tokens for b in self.bases.values()), default=2048)
        # Replicas split each chunk's datums between them: a chunk of each one's size per replica.
        micro_batch *= self.options.data_parallel_size
        return micro_batch if keys <= 1 else max(1, micro_batch // 2)

    def optim_step(self, model_id: str, params: OptimParams) -> dict[str, float]:
        p = self.placement(model_id)
        return p.runtime.optim_step(p.unit, params)

    def optim_steps(self, steps: list[tuple[str, OptimParams]]) -> list[dict[str, float] | Exception]:
        """Several runs' optimizer steps that arrived together: those on one base model's runtime
        are taken at once where it can (``TrainingRuntime.optim_steps``: one read-back of the
        gradient norms and one set of multi-tensor kernels for all), each exactly as alone.
        Each entry is that run's metrics or the error that refused its step."""
        results: list = [None] * len(steps)
        by_runtime: dict[int, tuple[Any, list[tuple[int, int, OptimParams]]]] = {}
        for i, (model_id, params) in enumerate(steps):
            try:
                p = self.placement(model_id)
            except TinsmithError as exc:
                results[i] = exc
                continue
            by_runtime.setdefault(id(p.runtime), (p.runtime, []))[1].append((i, p.unit, params))
        for runtime, entries in by_runtime.values():
            got = runtime.optim_steps([(unit, params) for _, unit, params in entries])
            for (i, _, _), r in zip(entries, got):
                results[i] = r
        return results

    def steps(self, model_id: str) -> int:
        """Optimizer steps the run has taken (restored with its optimizer state)."""
        p = self.placement(model_id)
        return p.runtime.unit(p.unit).steps

    # ----------------------------------------------------------------------------- checkpoints
    def export_training_state(self, model_id: str):
        from tinsmith.checkpoints.state_format import TrainingState

        p = self.placement(model_id)
        tr = p.runtime.unit(p.unit)
        weights, opt = p.runtime.export_full_state(p.unit)
        return TrainingState(p.base.name, p.lora, weights, opt, tr.steps,
                             normalize_optimizer_config({"type": tr.optimizer_type}))

    def writes_sharded(self, model_id: str) -> bool:
        """Whether the run's checkpoints are written by every data-parallel rank, each its own
        part (a full fine-tune sharded over ranks), rather than gathered here and written whole."""
        p = self.placement(model_id)
        return not p.is_lora and bool(getattr(p.runtime, "writes_sharded", False))

    def sharded_state_bytes(self, model_id: str) -> int:
        """The tensor bytes of a sharded run's training-state checkpoint, known from shapes."""
        p = self.placement(model_id)
        return p.runtime.state_bytes(p.unit)  # type: ignore[attr-defined]

    def save_training_state_sharded(self, model_id: str, directory: Path, what: str) -> int:
        """Write a sharded run's training state from every rank (see ``writes_sharded``); the
        bytes committed."""
        from tinsmith.checkpoints.state_format import state_header

        p = self.placement(model_id)
        tr = p.runtime.unit(p.unit)
        header = state_header(p.base.name, p.lora, tr.steps, normalize_optimizer_config({"type": tr.optimizer_type}))
        return p.runtime.save_state_sharded(p.unit, str(directory), header, what)  # type: ignore[attr-defined]

    def sharded_weights_bytes(self, model_id: str) -> int:
        """The tensor bytes of a sharded run's Hugging Face export, known from shapes (and the
        base checkpoint's untrained tensors it carries, from their files' headers)."""
        from tinsmith.checkpoints.export import untrained_bytes

        p = self.placement(model_id)
        return p.runtime.weights_bytes(p.unit) + untrained_bytes(p.base.loaded.model_dir)  # type: ignore[attr-defined]

    def save_full_weights_sharded(self, model_id: str, directory: Path, age_recipients: tuple[str, ...],
                                  what: str) -> int:
        """Write a sharded run's weights as a Hugging Face model directory from every rank."""
        p = self.placement(model_id)
        return p.runtime.save_hf_sharded(str(directory), str(p.base.loaded.model_dir),  # type: ignore[attr-defined]
                                         tuple(age_recipients), what)

    def load_training_state(self, model_id: str, base_model: str, state, create: bool, owner: str = "",
                            optimizer_type: str = ADAMW) -> None:
        """Create the run from ``state`` (create=True) or replace an existing run's state.

        A created run keeps the checkpoint's optimizer when its state is restored, else it gets
        ``optimizer_type`` (the client's ``optimizer_config`` of a weights-only load)."""
        if create:
            if model_id in self.placements:
                self.unload_model(model_id)
            kind = state.optimizer_type if state.optimizer is not None else optimizer_type
            self.create_model(model_id, base_model, state.lora, owner, kind)
        p = self.placement(model_id)
        if (p.lora is None) != (state.lora is None) or (p.lora and state.lora and (
                p.lora.rank != state.lora.rank or
                (p.lora.train_attn, p.lora.train_mlp, p.lora.train_unembed)
                != (state.lora.train_attn, state.lora.train_mlp, state.lora.train_unembed))):
            raise InvalidInputError(f"the checkpoint's LoRA configuration does not match model {model_id!r}")
        try:
            tr = p.runtime.unit(p.unit)
            if state.optimizer is not None and state.optimizer_type != tr.optimizer_type:
                raise InvalidInputError(
                    f"the checkpoint holds {state.optimizer_type} optimizer state but model {model_id!r} uses "
                    f"{tr.optimizer_type}; load its weights only (load_state) or create the run from the checkpoint")
            p.runtime.import_full_state(p.unit, state.weights, state.optimizer)
            p.runtime.set_steps(p.unit, state.steps if state.optimizer is not None else 0)
        except Exception:
            if create:
                self.unload_model(model_id)
            raise

    # ----------------------------------------------------------------------------- sampling
    def sampler(self, base: BaseModel, snapshot: Snapshot | None = None) -> Sampler:
        """The sampler of ``base`` (shared by its LoRA snapshots), or the one of a full snapshot
        (which must be resident: :meth:`make_resident`)."""
        if snapshot is not None and snapshot.is_full:  # (under data parallelism too: rank 0 samples it)
            if snapshot.model is None:
                raise RuntimeError(f"sampler snapshot {snapshot.key!r} is not resident")
            return self._sampler_of(snapshot.sampler_key, base, snapshot.model)
        if base.tp is not None:
            return base.tp.sampler
        return self._sampler_of(base.name, base, base.loaded.model)

    def _sampler_of(self, key: str, base: BaseModel, model: CausalLM) -> Sampler:
        if key not in self.samplers:
            # On a GPU an idle sampler keeps its K/V buffers (and the CUDA graphs over them) for the
            # next sampling phase; training that runs short of memory has them given back first.
            self.samplers[key] = Sampler(model, _tokenizer_decoder(base.loaded.model_dir), vision=base.loaded.vision,
                                         keep_cache_when_idle=next(model.parameters()).device.type == "cuda",
                                         **sampler_kwargs_of(self.options))
            self.samplers[key].release_elsewhere = lambda: self.release_idle_sampler_memory(but=key)
        return self.samplers[key]

    def release_idle_sampler_memory(self, but: str | None = None) -> int:
        """Have every idle sampler of this process (but sampler ``but``) give back the device memory it
        keeps; the bytes released. Samplers of a process group (tensor-parallel or data-parallel
        ranks) are left alone: their ranks must keep their caches alike."""
        return sum(sampler.release_memory() for key, sampler in list(self.samplers.items())
                   if key != but and isinstance(sampler, Sampler))

    # ----------------------------------------------------------------------------- inflight sampling
    def publish_inflight(self, model_id: str, key: str) -> None:
        """Make sampling session ``key`` follow run ``model_id``'s live weights (``kind="inflight"``).

        Nothing is copied and no snapshot is counted: each sample request reads the weights as
        they are when it is admitted and at each decode step after (see docs/sampling.md).
        """
        self.placement(model_id)  # the run must be held
        self.inflight[key] = model_id

    def live_sampler(self, key: str) -> tuple[Sampler, int | None]:
        """The sampler, and the adapter slot, that read the live weights of inflight session ``key``."""
        model_id = self.inflight[key]
        p = self.placements.get(model_id)
        if p is None:
            raise StateLostError(f"the training run {model_id!r} that inflight sampler {key!r} follows is no longer "
                                 "held (unloaded or lost in a restart)")
        if p.is_lora:
            p.runtime.ensure_resident({p.unit})  # a parked adapter comes back into its slot
            return self.sampler(p.base), p.runtime.unit(p.unit).slot
        if p.base.tp is not None:  # its weights are sharded: rank 0 samples a whole copy kept current
            return self._sampler_of(_live_sampler_key(model_id), p.base, self._live_copy(model_id, p)), None
        return self._sampler_of(_live_sampler_key(model_id), p.base, p.runtime.model), None

    def _live_copy(self, model_id: str, p: Placement) -> CausalLM:
        """The whole model an inflight sampler of sharded full fine-tune ``model_id`` reads, on rank
        0's device in the base model's dtype, holding the run's current weights. Made at its first
        sample (one per run, kept while the run is held: a full fine-tune's samples follow each
        other, round after round) and written in place from then on, so the sampler (its K/V
        buffers, CUDA graphs) stays the same."""
        live = self.live_copies.get(model_id)
        if live is None:
            template = p.base.loaded.model  # rank 0's base model (a shard of it under tensor parallelism)
            param = next(template.parameters())

            def build() -> CausalLM:
                return empty_model(template.config, param.device, param.dtype)

            try:
                model = build()
            except torch.OutOfMemoryError:
                if not self.release_idle_sampler_memory():  # idle samplers' K/V first, then try again once
                    raise CapacityError(f"no room on {param.device} for the whole weights of {model_id!r} that its "
                                        "inflight sampler reads; unload runs or snapshots, or sample a snapshot "
                                        "(save_weights_and_get_sampling_client)") from None
                torch.cuda.empty_cache()
                model = build()
            live = self.live_copies[model_id] = LiveCopy(model)
        self._refresh_live(p, live)
        return live.model

    def _refresh_live(self, p: Placement, live: LiveCopy) -> None:
        """Gather the run's weights into ``live`` when a step or a load changed them since (every
        rank joins; each weight goes from the shards into the copy on the device, no host trip)."""
        version = p.runtime.model.weights_version(None)
        if live.version == version:
            return
        p.runtime.gather_live(live.model)  # type: ignore[attr-defined]
        live.version = version
        self.stats["live_weight_gathers"] += 1

    def refresh_live_copies(self) -> None:
        """Before a sampling slice: inflight samplers of sharded full fine-tunes that are decoding
        read the run's current weights from their next decode step on, as one process's do (its
        sampler reads the live model itself)."""
        for model_id, live in self.live_copies.items():
            p = self.placements.get(model_id)
            sampler = self.samplers.get(_live_sampler_key(model_id))
            if p is not None and sampler is not None and sampler.has_work():
                self._refresh_live(p, live)

    def _sampler_slots(self, base_name: str) -> set[int]:
        sampler = self.samplers.get(base_name)
        return set() if sampler is None else sampler.slots_in_use()

    def _adapter_parked(self, base_name: str, slot: int) -> None:
        """A training run's adapter that inflight samples were reading left the model (more runs
        train than --max-lora-adapters): fail those samples rather than let them go on with the
        base weights alone."""
        self.samplers[base_name].fail_slot(slot, CapacityError(
            "the LoRA adapter this inflight sampler reads was moved to host memory to make room for other "
            f"training runs (--max-lora-adapters {self.options.max_lora_adapters}); sample again"))

    def _forget_sampler(self, key: str) -> None:
        sampler = self.samplers.pop(key, None)
        if sampler is not None:
            self.retired_sampler_stats.update(sampler.stats)

    def sampler_totals(self) -> Counter[str]:
        """Every sampler's counters (decode steps, prefill tokens, ...) summed, forgotten ones included."""
        total = Counter(self.retired_sampler_stats)
        for sampler in list(self.samplers.values()):
            total.update(dict(sampler.stats))
        return total

    def drop_idle_live_samplers(self) -> None:
        """Forget the samplers of unloaded runs' live weights once they have nothing left to decode
        (a sampler still decoding keeps its run's model until its requests finish)."""
        for key in [k for k in self.samplers if k.startswith(_LIVE_PREFIX)]:
            model_id = key[len(_LIVE_PREFIX):]
            if model_id not in self.placements and not self.samplers[key].has_work():
                self._forget_sampler(key)
                self.live_copies.pop(model_id, None)

    def adapter_weights(self, model_id: str) -> tuple[LoraSpec, dict[str, torch.Tensor], BaseModel]:
        p = self.placement(model_id)
        if not p.is_lora:
            raise InvalidInputError(f"model {model_id!r} is a full fine-tune; only LoRA runs can be sampled or exported as adapters")
        return p.lora, p.runtime.adapter_tensors(p.unit), p.base

    def full_weights(self, model_id: str) -> tuple[dict[str, torch.Tensor], BaseModel]:
        """A full fine-tune's live weights under their Hugging Face names (not copies: read them
        before the next job runs on this worker thread)."""
        p = self.placement(model_id)
        if p.is_lora:
            raise InvalidInputError(f"model {model_id!r} is a LoRA run, not a full fine-tune")
        return dict(self._full_named_weights(p)), p.base

    @staticmethod
    def _full_named_weights(p: Placement):
        """A full fine-tune's weights, (name, tensor) pairs: live ones, or under data parallelism
        the shards gathered into host memory."""
        if p.base.tp is not None:
            return list(p.runtime.export_weights().items())  # type: ignore[attr-defined]
        return [(n, t.detach()) for n, t in p.runtime.unit(p.unit).named_params]

    def snapshot(self, model_id: str, key: str, *, owner: str = "", reloadable: bool = False,
                 queued: Collection[str] = ()) -> Snapshot:
        """Freeze the run's current adapter under ``key`` (a sampler id or a tinker path) for ``owner``.

        ``queued``: snapshot keys that sample requests not yet handed to a sampler will read;
        those snapshots are in use and are never evicted to make room.
        """
        p = self.placement(model_id)
        if not p.is_lora:
            return self._install_full_snapshot(key, p.base, self._full_named_weights(p), reloadable, owner, queued)
        spec, tensors, base = self.adapter_weights(model_id)
        return self._install_snapshot(key, base, spec, tensors, reloadable, owner, queued)

    def load_snapshot(self, key: str, base_model: str, directory: Path, *, owner: str = "",
                      queued: Collection[str] = ()) -> Snapshot:
        """Bring stored sampler weights back into memory (after an eviction or a restart)."""
        from tinsmith.checkpoints.peft_format import load_peft_adapter

        if key in self.snapshots:
            return self.use_snapshot(key)
        if not (directory / "adapter_config.json").is_file() and ((directory / "model.safetensors").is_file() or (
                directory / "model.safetensors.index.json").is_file()):  # one file, or shards written by every rank
            return self._load_full_snapshot(key, self.resolve_base(base_model), directory, owner, queued)
        self._snapshot_victims(owner, queued)  # refuse before reading the file when there is no room
        spec, tensors = load_peft_adapter(directory)
        return self._install_snapshot(key, self.resolve_base(base_model), spec, tensors, True, owner, queued)

    def use_snapshot(self, key: str) -> Snapshot:
        snap = self.snapshots[key]
        snap.last_used = time.monotonic()
        return snap

    def snapshot_used(self, key: str) -> None:
        """A request on ``key`` finished: its idle time counts from now."""
        snap = self.snapshots.get(key)
        if snap is not None:
            snap.last_used = time.monotonic()

    def _install_snapshot(self, key: str, base: BaseModel, spec: LoraSpec, tensors, reloadable: bool, owner: str,
                          queued: Collection[str]) -> Snapshot:
        old = self.snapshots.get(key)
        # Room is made before anything changes: if none can be made, the request fails and
        # every snapshot held stays as it was.
        victims = [] if old is not None else self._snapshot_victims(owner, queued)
        slot = next(self._snapshot_slots)
        if base.tp is not None:
            base.tp.install_lora(slot, spec, tensors)  # full-size tensors: each rank keeps its shards
        else:
            install_lora_weights(base.loaded.model, slot, spec, tensors)
        self._evict(victims, owner)
        if old is not None:
            self._drop_snapshot(old)
        snap = Snapshot(key, base, slot, spec, reloadable, owner)
        self.snapshots[key] = snap
        return snap

    def _evict(self, victims: list[Snapshot], owner: str) -> None:
        for victim in victims:
            del self.snapshots[victim.key]
            self._drop_snapshot(victim)
            self.stats["snapshot_evictions"] += 1
            log.warning("evicted %s sampler snapshot %s of key %s to make room for one of key %s "
                        "(--max-sampler-snapshots %d, --max-sampler-snapshots-per-key %s); %s",
                        "stored" if victim.reloadable else "in-memory", victim.key, key_id(victim.owner),
                        key_id(owner), self.options.max_sampler_snapshots,
                        self.options.max_sampler_snapshots_per_key or "off",
                        "it is reloaded from disk on its next request" if victim.reloadable
                        else "its sampling client must save the weights again")

    def _install_full_snapshot(self, key: str, base: BaseModel, weights, reloadable: bool, owner: str,
                               queued: Collection[str]) -> Snapshot:
        """Freeze a full fine-tune's ``weights`` ((name, tensor) pairs) in host memory for a sampler.

        Room (a place among ``max_full_sampler_snapshots`` and the host-byte caps) is made before
        anything is copied; the device copy is made only when a request samples it.
        """
        old = self.snapshots.get(key)
        weights = list(weights)
        incoming = sum(t.numel() * t.element_size() for _, t in weights)
        victims = [] if old is not None else self._snapshot_victims(owner, queued, full_bytes=incoming)
        host = _host_copy(weights, pin=torch.device(self.options.device).type == "cuda")
        self._evict(victims, owner)
        if old is not None:
            self._drop_snapshot(old)
        snap = Snapshot(key, base, None, None, reloadable, owner, host=host, host_bytes=incoming)
        self.snapshots[key] = snap
        return snap

    def _load_full_snapshot(self, key: str, base: BaseModel, directory: Path, owner: str,
                            queued: Collection[str]) -> Snapshot:
        """A full fine-tune's stored sampler weights (a Hugging Face model directory, in its
        family's layout: experts one tensor each or fused, an image-text model's decoder nested)
        back in host memory, read by the model loader as any checkpoint is."""
        params = _whole_parameters(base.loaded.model)
        incoming = sum(p.numel() * p.element_size() for p in params.values())
        self._snapshot_victims(owner, queued, full_bytes=incoming)  # refuse before reading when there is no room
        unfit = f"stored sampler weights at {str(directory)!r} do not fit {base.name!r}"
        try:  # memory-mapped: the snapshot's host copy is the one copy made
            stored = dict(load_model(str(directory), dtype=next(iter(params.values())).dtype, pack=False)
                          .model.named_parameters())
        except (InvalidInputError, NotFoundError) as exc:  # another model's weights; files gone
            raise InvalidInputError(f"{unfit}: {exc}") from None
        if stored.keys() != params.keys() or any(stored[n].shape != p.shape for n, p in params.items()):
            raise InvalidInputError(unfit)
        return self._install_full_snapshot(key, base, list(stored.items()), True, owner, queued)

    def make_resident(self, snap: Snapshot) -> bool:
        """Put full snapshot ``snap`` on the device for its sampler, offloading the least recently
        used resident snapshots that are not decoding if ``resident_full_sampler_snapshots`` are
        already there. False when every resident one is decoding: the request waits its turn.

        An offloaded snapshot loses only its device copy (and its sampler, with no work left);
        its host copy stays, so it comes back unchanged.
        """
        if snap.model is not None:
            return True
        resident = [s for s in self.snapshots.values() if s.is_full and s.model is not None]
        need = len(resident) + 1 - self.options.resident_full_sampler_snapshots
        if need > 0:
            free = sorted((s for s in resident if not self._decoding(s)), key=lambda s: s.last_used)
            if len(free) < need:
                return False
            for s in free[:need]:
                self._offload(s)
        try:
            snap.model = _device_model(snap.base.loaded.model, snap.host)
        except torch.OutOfMemoryError:
            if not self.release_idle_sampler_memory():  # idle samplers' K/V first, then try again once
                raise
            torch.cuda.empty_cache()
            snap.model = _device_model(snap.base.loaded.model, snap.host)
        if snap.model.model.embed_tokens.weight.device.type == "cpu":
            # The device is host memory: the host copy can be the resident one (no second copy).
            snap.host = {n: p.detach() for n, p in snap.model.named_parameters()}
        return True

    def resident_snapshots(self) -> list[str]:
        return [s.key for s in self.snapshots.values() if s.is_full and s.model is not None]

    def _decoding(self, snap: Snapshot) -> bool:
        sampler = self.samplers.get(snap.sampler_key)
        return sampler is not None and sampler.has_work()

    def _offload(self, snap: Snapshot) -> None:
        self._forget_sampler(snap.sampler_key)
        snap.model = None

    def _drop_snapshot(self, snap: Snapshot) -> None:
        if snap.is_full:
            self._offload(snap)
            snap.host = None
            return
        if snap.base.tp is not None:
            snap.base.tp.detach_lora(snap.slot)
            return
        detach_lora(snap.base.loaded.model, snap.slot)

    def _snapshot_victims(self, owner: str, queued: Collection[str], full_bytes: int | None = None) -> list[Snapshot]:
        """The snapshots to evict so that ``owner`` may hold one more; CapacityError if it cannot.

        A snapshot with sample requests queued or running is never evicted. Another owner's
        snapshot is evicted only when it is also idle (unused for ``sampler_snapshot_idle_s``).
        The order of preference: the owner's own idle snapshots, then its own stored ones
        (reloaded from disk on their next request), then other owners' idle snapshots (stored
        ones first, then least recently used), and last the owner's own recently used in-memory
        snapshots. A stored snapshot loses nothing when evicted; an in-memory one (from
        ``save_weights_and_get_sampling_client``) is gone, and its sampler gets a clear error.

        ``full_bytes``: the new snapshot is a full fine-tune's, of that many bytes of host memory;
        it also needs one of the ``max_full_sampler_snapshots`` places and room under the host-byte
        caps (``max_snapshot_host_bytes`` for the server, ``max_snapshot_host_bytes_per_key``).
        """
        o = self.options
        now = time.monotonic()
        busy = {s for sampler in self.samplers.values() for s in sampler.slots_in_use()}
        queued = set(queued)

        def in_use(s: Snapshot) -> bool:
            if s.is_full:
                return s.key in queued or self._decoding(s)
            return s.slot in busy or s.key in queued

        def idle(s: Snapshot) -> bool:
            return not in_use(s) and now - s.last_used >= o.sampler_snapshot_idle_s

        def preference(s: Snapshot) -> tuple:
            own = s.owner == owner
            tier = 0 if own and idle(s) else 1 if own and s.reloadable else 2 if not own else 3
            return (tier, not s.reloadable, s.last_used)

        victims: list[Snapshot] = []
        own = [s for s in self.snapshots.values() if s.owner == owner]
        cap = o.max_sampler_snapshots_per_key
        if cap is not None and len(own) + 1 > cap:
            need = len(own) + 1 - cap
            candidates = sorted((s for s in own if not in_use(s)), key=preference)
            if len(candidates) < need:
                log.warning("refused a sampler snapshot to key %s: its %d snapshots are all in use "
                            "(--max-sampler-snapshots-per-key %d)", key_id(owner), len(own), cap)
                raise CapacityError(
                    f"this API key already holds {len(own)} sampler snapshots with sample requests queued or running, "
                    f"the most this server allows per key (--max-sampler-snapshots-per-key {cap}); wait for some to "
                    "finish before saving weights for another sampler"
                )
            victims += candidates[:need]
        need = len(self.snapshots) - len(victims) + 1 - o.max_sampler_snapshots
        if need > 0:
            chosen = {id(v) for v in victims}
            candidates = sorted((s for s in self.snapshots.values() if id(s) not in chosen and not in_use(s)
                                 and (s.owner == owner or idle(s))), key=preference)
            if len(candidates) < need:
                log.warning("refused a sampler snapshot to key %s: the %d the server holds are all in use or "
                            "recently used (--max-sampler-snapshots)", key_id(owner), o.max_sampler_snapshots)
                raise CapacityError(
                    f"no room for another sampler snapshot: the {o.max_sampler_snapshots} this server holds "
                    f"(--max-sampler-snapshots) are all in use (sample requests queued or running, or used in the last "
                    f"{o.sampler_snapshot_idle_s:g} s); try again when some are idle"
                )
            victims += candidates[:need]
        if full_bytes is not None:
            victims += self._full_snapshot_victims(owner, full_bytes, victims, in_use, idle, preference)
        return victims


    def _full_snapshot_victims(self, owner: str, incoming: int, chosen: list[Snapshot], in_use, idle,
                               preference) -> list[Snapshot]:
        """More victims (beyond ``chosen``) so that a full snapshot of ``incoming`` host bytes fits:
        a place among ``max_full_sampler_snapshots``, and room under the server's and the owner's
        host-byte caps. Only full snapshots free those; the owner's own first (any not in use),
        other owners' only when idle."""
        o = self.options
        for cap, name in ((o.max_snapshot_host_bytes, "--max-snapshot-host-bytes"),
                          (o.max_snapshot_host_bytes_per_key, "--max-snapshot-host-bytes-per-key")):
            if cap is not None and incoming > cap:
                raise CapacityError(f"a sampler snapshot of this full fine-tune needs {incoming} bytes of host memory, "
                                    f"more than this server allows ({name} {cap})")
        gone = {id(v) for v in chosen}
        held = [s for s in self.snapshots.values() if s.is_full and id(s) not in gone]
        own = [s for s in held if s.owner == owner]
        picked: list[Snapshot] = []

        def pick(pool: list[Snapshot], fits) -> bool:
            for s in sorted(pool, key=preference):
                if fits():
                    return True
                if s not in picked:
                    picked.append(s)
            return fits()

        def left(pool: list[Snapshot]) -> list[Snapshot]:
            return [s for s in pool if s not in picked]

        def bytes_of(pool: list[Snapshot]) -> int:
            return sum(s.host_bytes for s in pool)

        per_key = o.max_snapshot_host_bytes_per_key
        if per_key is not None and not pick([s for s in own if not in_use(s)],
                                            lambda: bytes_of(left(own)) + incoming <= per_key):
            raise CapacityError(
                f"this API key's sampler snapshots of full fine-tunes hold {bytes_of(own)} bytes of host memory and "
                f"are in use; another needs {incoming} more (--max-snapshot-host-bytes-per-key {per_key}); wait for "
                "some to finish before saving weights for another sampler")
        server = o.max_snapshot_host_bytes
        fits = lambda: (len(left(held)) + 1 <= o.max_full_sampler_snapshots  # noqa: E731
                        and (server is None or bytes_of(left(held)) + incoming <= server))
        if not pick([s for s in held if not in_use(s) and (s.owner == owner or idle(s))], fits):
            raise CapacityError(
                f"no room for another sampler snapshot of a full fine-tune: each is a copy of the whole model in host "
                f"memory, and the {len(held)} this server holds ({bytes_of(held)} bytes; --max-full-sampler-snapshots "
                f"{o.max_full_sampler_snapshots}, --max-snapshot-host-bytes {server or 'off'}) are in use; try again "
                "when one is idle")
        return picked


def _frozen_copy(model: CausalLM) -> CausalLM:
    """A copy of ``model`` that shares no tensor with it (later training cannot reach it), with
    no gradients and its projections packed for sampling."""
    copied = copy.deepcopy(model)
    if copied.config.tie_word_embeddings:
        copied.lm_head.weight = copied.model.embed_tokens.weight
    for p in copied.parameters():
        p.grad = None
        p.requires_grad_(False)
    pack_weights(copied)
    return copied


_LIVE_PREFIX = "live:"


def _live_sampler_key(model_id: str) -> str:
    """The sampler over a full fine-tune's live model (inflight sessions of that run share it)."""
    return _LIVE_PREFIX + model_id


def _host_copy(weights, *, pin: bool) -> dict[str, torch.Tensor]:
    """Frozen copies of ``weights`` in host memory; pinned when they will be copied to a CUDA
    device (faster, asynchronous transfers)."""
    out = {}
    for name, t in weights:
        h = t.detach().to("cpu", copy=True)
        out[name] = h.pin_memory() if pin else h
    return out


def _sharded(model: CausalLM) -> bool:
    shards = getattr(model, "tp", None)
    return shards is not None and shards.size > 1


def _whole_parameters(model: CausalLM) -> dict[str, torch.Tensor]:
    """The whole model's parameters by name, in ``model``'s dtype (for a tensor-parallel shard:
    meta tensors of the whole model's shapes)."""
    if not _sharded(model):
        return dict(model.named_parameters())
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        whole = CausalLM(model.config)
    return {n: p.to(dtype) for n, p in whole.named_parameters()}


def _device_model(template: CausalLM, host: dict[str, torch.Tensor]) -> CausalLM:
    """A frozen model on ``template``'s device with the weights of ``host``, packed for sampling.
    A tensor-parallel shard is no template for a whole model: one is built from its config."""
    if _sharded(template):
        p = next(template.parameters())
        return model_from_weights(template.config, host, p.device, p.dtype)
    model = _frozen_copy(template)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the parameters are views of the packed buffers
            p.copy_(host[name].to(p.device, p.dtype, non_blocking=True))
    return model


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


def training_runtime(loaded, o: RuntimeOptions) -> TrainingRuntime:
    """The LoRA training runtime of a loaded base model, as the options ask (micro-batches sized
    from free memory and recomputation above that size unless configured): the server's, and what
    benchmarks that must train as the server does build."""
    micro = o.micro_batch_tokens or auto_micro_batch_tokens(loaded.config, loaded.model, o)
    return TrainingRuntime(
        loaded.model, max_lora_adapters=o.max_lora_adapters, max_lora_rank=o.max_lora_rank,
        max_training_runs=o.max_training_runs, micro_batch_tokens=micro, micro_batch_seqs=o.micro_batch_seqs,
        gradient_checkpointing=o.gradient_checkpointing, vision=loaded.vision,
        checkpoint_above_tokens=auto_checkpoint_above(micro, loaded.model, o), packing=o.train_packing,
    )


def auto_checkpoint_above(micro_batch_tokens: int, model, o: RuntimeOptions) -> int | None:
    """On a GPU without ``--gradient-checkpointing``: micro-batches larger than a planned one (a
    single sequence longer than the budget) recompute their activations in backward, so that a
    long sequence fits without the user setting anything. Elsewhere: only as configured."""
    if o.gradient_checkpointing or next(model.parameters()).device.type != "cuda":
        return None
    return micro_batch_tokens


def sampler_kwargs_of(options: RuntimeOptions) -> dict:
    """The sampler arguments every sampler of a base model takes from the options, in one process
    or on every tensor-parallel rank alike (a rank's captured decode steps hold its collectives:
    the ranks capture and replay in step)."""
    return dict(cuda_graphs=options.sampler_cuda_graphs, run_ahead=None if options.sampler_run_ahead else False,
                max_rows=options.max_sampling_rows, prefix_cache_bytes=options.prefix_cache_bytes,
                kv_cache_bytes=options.sampler_kv_cache_bytes, prefill_chunk_tokens=options.sampler_prefill_chunk_tokens,
                kv_layout=options.sampler_kv_cache_layout)


def auto_micro_batch_tokens(cfg: ModelConfig, model, o: RuntimeOptions) -> int:
    """Tokens per training micro-batch (padded ones, or real ones when packed) when none is configured.

    On CPU, 2048: measured on the tiny models, larger batches fall out of cache (16384 ran ~12%
    slower per token than 4096, and 4096 ~12% slower than 2048 when four tenants' 8 x 128 steps
    share one call, while 32 x 512 ran alike at 1024-4096). On a GPU, as many as half the free memory (within
    ``--device-memory-fraction``) holds, at a rough
    activation cost per token (:mod:`tinsmith.worker.activation_memory`), within [1024, 65536].
    Logits cost nothing per token: they are computed in fixed-size chunks (``logit_chunk_bytes``,
    a few such buffers at once), set aside from the free memory first.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 2048
    free, _ = device_memory.free_and_total(device)
    width = 2 if next(model.parameters()).dtype in (torch.bfloat16, torch.float16) else 4
    per_token = activation_bytes_per_token(cfg, width, cfg.num_layers if o.gradient_checkpointing else 0)
    free -= 4 * DEFAULT_CHUNK_BYTES
    return int(min(65536, max(1024, 0.5 * free / per_token)))
