"""Serving base models under tensor parallelism: the worker's runtime and sampler, every rank in step.

The worker (:class:`tinsmith.worker.service.Worker`) keeps calling the same methods it calls on a
:class:`TrainingRuntime` and a :class:`Sampler`; under ``--tensor-parallel-size N`` a base model's
``lora`` runtime is a :class:`TPRuntime` and its sampler a :class:`TPSampler`. Each turns a call
into one call of the group's executor (:class:`LocalTPGroup`, or the Ray group of ``ray_group``),
which runs it on every rank's :class:`ServingRank` with the same arguments, so every rank's
runtime and sampler go through the same states: adapters get the same unit ids and slots, passes
the same ids, and every rank's sampler holds the same rows. Rank 0 (this process) answers; its
objects are the ones the worker reads (steps, slots, rows) without a call.

What would otherwise differ between ranks is decided by rank 0 and sent to the others: the
random seed of an adapter or a sample request when the client gave none, how many decode steps a sampling slice runs (a
time budget: :class:`~tinsmith.parallel.sampling.LockstepSampler`), which requests were cancelled,
and the micro-batch size picked from free device memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from tinsmith.errors import CapacityError, InvalidInputError
from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import LoadedModel
from tinsmith.parallel.group import DEFAULT_TIMEOUT_S, ParallelError, TPGroup
from tinsmith.parallel.runtime import TPTrainingRuntime
from tinsmith.parallel.sampling import LockstepSampler, install_full_lora_weights
from tinsmith.parallel.shard import load_shard, tp_divisors
from tinsmith.parallel.state import gather_full
from tinsmith.parallel.worker import DrivenGroup, LocalTPGroup
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import LoraSpec
from tinsmith.worker.runtime import FbPass, TrainRequest
from tinsmith.worker.trainables import detach_lora, lora_tensors
from tinsmith.worker.warm_up import configure_device

OPTION = "--tensor-parallel-size"


def check_servable(cfg: ModelConfig, size: int, name: str) -> None:
    """Refuse, naming the option, a model the tensor-parallel code does not cover (before any rank loads it)."""
    why = None
    for n, what in tp_divisors(cfg):
        if n % size:
            why = f"its {what} ({n}) do not divide by {size}"
            break
    hk = cfg.num_kv_heads  # fewer than the ranks: each kept by several (see shard.kv_heads_of_rank)
    if why is None and hk % size and size % hk:
        why = f"its key/value heads ({hk}) neither divide by {size} nor divide it"
    if why is not None:
        raise InvalidInputError(f"{name} ({cfg.family}) cannot be served with {OPTION} {size}: {why}; "
                                f"serve it with {OPTION} 1")


def rank_device(device: str, rank: int, option: str = OPTION) -> torch.device:
    """Rank ``rank``'s device: its own GPU (``cuda:rank``, counted from the index of ``device``), or the CPU."""
    d = torch.device(device)
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise InvalidInputError(f"{option} runs on CUDA GPUs or on the CPU, not on {device!r}")
    return torch.device("cuda", (d.index or 0) + rank)


def _tokenizer_decoder(model_dir: Path):
    from tinsmith.worker.service import _tokenizer_decoder as decoder  # late: the worker imports this module

    return decoder(model_dir)


class RankBase:
    """One base model on one rank: its shard, the training runtime and the sampler over it."""

    def __init__(self, tp: TPGroup, device: torch.device, model_dir: str, dtype: torch.dtype, runtime_kwargs: dict,
                 sampler_kwargs: dict):
        runtime_kwargs = configured_rank(device, runtime_kwargs)
        loaded = load_shard(model_dir, tp, dtype)  # one layer at a time: only the shard is kept
        model = loaded.model.to(device)
        # An image-text model's vision tower runs whole on every rank (frozen; the decoder it feeds is sharded).
        vision = None if loaded.vision is None else loaded.vision.to(device)
        self.loaded = dataclasses.replace(loaded, model=model, vision=vision)
        self.runtime = TPTrainingRuntime(model, vision=vision, **runtime_kwargs)
        # Splitting a micro-batch after running out of memory would happen on one rank only.
        self.runtime.oom_retry = False
        self.sampler = LockstepSampler(model, _tokenizer_decoder(loaded.model_dir), vision=vision, **sampler_kwargs)
        self.runtime.busy_slots = self.sampler.slots_in_use
        self.runtime.on_park_busy = self._adapter_parked
        self.passes: dict[int, FbPass] = {}
        self.max_lora_adapters = runtime_kwargs.get("max_lora_adapters", 16)
        self.shard = tp  # the group this rank's shard of the model is cut over
        self.gradient_checkpointing = runtime_kwargs.get("gradient_checkpointing", False)
        self.full: dict[str, Any] = {}  # model_id -> its full fine-tune (a ReplicaFullRun: FSDP over the group)

    def _adapter_parked(self, slot: int) -> None:
        self.sampler.fail_slot(slot, CapacityError(
            "the LoRA adapter this inflight sampler reads was moved to host memory to make room for other "
            f"training runs (--max-lora-adapters {self.max_lora_adapters}); sample again"))


class ServingRank:
    """What every rank of a serving group holds: its :class:`RankBase` per base model. Its methods
    are the executor's calls; every rank runs each with the same arguments."""

    def __init__(self, tp: TPGroup, device: torch.device):
        self.tp, self.device = tp, device
        self.bases: dict[str, RankBase] = {}
        self.local_keys: dict[int, Any] = {}  # rank 0: the engine's keys of the tasks a sample call adds

    def add_base(self, name: str, model_dir: str, dtype: torch.dtype, runtime_kwargs: dict,
                 sampler_kwargs: dict) -> RankBase:
        self.bases[name] = base = RankBase(self.tp, self.device, model_dir, dtype, runtime_kwargs, sampler_kwargs)
        return base

    OPTION = OPTION  # what made the worker a group, for messages

    def _holder(self, name: Any) -> Any:
        """What a call's ``name`` addresses: a base model (its ``runtime`` and ``passes``), or with
        ``(base, model_id)`` that base's full fine-tune."""
        if isinstance(name, tuple):
            return self.bases[name[0]].full[name[1]]
        return self.bases[name]

    def create_full(self, name: str, model_id: str, optimizer_type: str) -> Any:
        """A full fine-tune of base ``name``, sharded with FSDP over every rank of the group."""
        from tinsmith.parallel.replicas import ReplicaFullRun  # late: replicas builds on this module

        base = self.bases[name]
        try:
            run = ReplicaFullRun(base, self.tp, optimizer_type)
        except torch.OutOfMemoryError:
            # The same words on every rank that ran out (each one's sizes would differ), so that
            # the group stays in step when all of them did.
            raise CapacityError(f"no room on the devices for a full fine-tune of {name!r} beside what they hold; "
                                "unload runs or use a LoRA config") from None
        base.full[model_id] = run
        return run

    def drop_full(self, name: str, model_id: str) -> None:
        self.bases[name].full.pop(model_id, None)

    def gather_live(self, key: tuple[str, str]) -> None:
        """Full fine-tune ``key``'s whole weights gathered on every rank, into the model its
        inflight sampler reads where this rank holds one (rank 0; the others pass each on)."""
        run = self._holder(key)
        run.runtime.gather_weights_into(run.live)

    def configure(self, name: str, micro_batch_tokens: int, checkpoint_above_tokens: int | None) -> None:
        rt = self.bases[name].runtime
        rt.micro_batch_tokens, rt.checkpoint_above_tokens = micro_batch_tokens, checkpoint_above_tokens

    def runtime(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """A method of the base's runtime (create_adapter, optim_step, forward_backward...)."""
        return getattr(self._holder(name).runtime, method)(*args, **kwargs)

    def set_steps(self, name: str, unit: int, steps: int) -> None:
        self._holder(name).runtime.unit(unit).steps = steps

    def adapter_tensors(self, name: str, unit: int) -> dict[str, torch.Tensor]:
        rt = self.bases[name].runtime
        tr = rt.unit(unit)
        if tr.slot is not None:
            rt.ensure_resident({unit})  # its shards on the device, where the collective gathers them
        return gather_full(lora_tensors(tr), rt.shard_dims, self.tp)

    def begin(self, name: str, requests: list[TrainRequest]) -> FbPass:
        b = self._holder(name)
        p = b.runtime.begin(requests)
        if not p.done:
            b.passes[p.id] = p
        return p

    def advance(self, name: str, quotas: list[tuple[int, int]], budget: int | None) -> list[int]:
        """Advance passes (by id); the ids of those that completed."""
        b = self._holder(name)
        passes = [(b.passes[i], q) for i, q in quotas]
        b.runtime.advance(passes, None, budget=budget)
        done = [i for i, _ in quotas if b.passes[i].done]
        for i in done:
            del b.passes[i]
        return done

    def install_lora(self, name: str, slot: int, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        install_full_lora_weights(self.bases[name].loaded.model, slot, spec, tensors)

    def detach_lora(self, name: str, slot: int) -> None:
        detach_lora(self.bases[name].loaded.model, slot)

    def sample_step(self, name: str, tasks: list[tuple[int, int | None, Any, str | None]], budget_s: float) -> list:
        """Queue ``tasks`` ((id, slot, input, owner)) and run one sampling slice; ``(key, result)`` of
        the requests that finished (keys: the engine's on rank 0, the ids elsewhere)."""
        sampler = self.bases[name].sampler
        for tid, slot, inp, owner in tasks:
            sampler.add_agreed(tid, self.local_keys.pop(tid, tid), slot, inp, owner)
        done = sampler.step(budget_s)
        for key, _ in done:
            sampler.forget(key)
        return done

    def sample_abort(self, name: str) -> list:
        sampler = self.bases[name].sampler
        keys = sampler.abort()
        for key in keys:
            sampler.forget(key)
        return keys


def _serving_rank(tp: TPGroup, device: torch.device) -> ServingRank:
    return ServingRank(tp, device)


def start_group(world_size: int, device: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                follower_threads: int = 1, ray_address: str | None = None,
                ray_strategy: str = "STRICT_PACK", make_target: Callable = _serving_rank,
                option: str = OPTION, label: str = "tensor-parallel") -> DrivenGroup:
    """The serving group: this process is rank 0, the other ranks are child processes (gloo on
    the CPU, NCCL with one GPU per rank), or Ray actors placed on the cluster at ``ray_address``.
    Each rank holds what ``make_target`` builds (a :class:`ServingRank` of shards by default)."""
    if ray_address is not None:
        from tinsmith.parallel.ray_group import RayTPGroup

        if torch.device(device).type not in ("cpu", "cuda"):
            raise InvalidInputError(f"{option} runs on CUDA GPUs or on the CPU, not on {device!r}")
        return RayTPGroup(world_size, ray_address, make_target, cuda=torch.device(device).type == "cuda",
                          strategy=ray_strategy, timeout_s=timeout_s, follower_threads=follower_threads, label=label)
    devices = [rank_device(device, r, option) for r in range(world_size)]
    if devices[0].type == "cuda" and torch.cuda.device_count() < devices[-1].index + 1:
        raise InvalidInputError(f"{option} {world_size} needs GPUs {devices[0].index}..{devices[-1].index}; "
                                f"this host has {torch.cuda.device_count()}")
    return LocalTPGroup(None, world_size, timeout_s=timeout_s, follower_threads=follower_threads,
                        make_target=make_target, devices=devices, label=label)


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors sent to the other ranks travel pickled; from host memory, so that no rank reads
    rank 0's GPU (each moves its shards to its own device)."""
    return {k: v.detach().cpu() for k, v in tensors.items()}


class TPBase:
    """Rank 0's handle on one base model served by the group: its runtime and sampler stand-ins."""

    def __init__(self, group: DrivenGroup, name: str, model_dir: str, dtype: torch.dtype, runtime_kwargs: dict,
                 sampler_kwargs: dict, runtime_class: type | None = None, sampler_class: type | None = None):
        self.group, self.name = group, name
        self.local: RankBase = group.call("add_base", name, model_dir, dtype, runtime_kwargs, sampler_kwargs)
        self.runtime = (runtime_class or TPRuntime)(self)
        self.sampler = (sampler_class or TPSampler)(self)

    @property
    def loaded(self) -> LoadedModel:
        return self.local.loaded

    @property
    def model(self) -> CausalLM:
        return self.local.loaded.model

    def call(self, method: str, *args: Any) -> Any:
        return self.group.call(method, self.name, *args)

    def configure(self, micro_batch_tokens: int, checkpoint_above_tokens: int | None) -> None:
        self.call("configure", micro_batch_tokens, checkpoint_above_tokens)

    def install_lora(self, slot: int, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Frozen full-size adapter weights (a sampler snapshot) into ``slot`` on every rank."""
        self.call("install_lora", slot, spec, _on_host(tensors))

    def detach_lora(self, slot: int) -> None:
        self.call("detach_lora", slot)

    def local_keys_put(self, tid: int, key: Any) -> None:
        """Rank 0's sampler gets the engine's key of task ``tid`` (the other ranks use the id)."""
        self.group.executor.target.local_keys[tid] = key


class TPRuntime:
    """The :class:`TrainingRuntime` methods the worker calls, run on every rank; reads of state
    (units, steps, sizes) come from rank 0's runtime, which every rank's equals."""

    _READS = frozenset({"unit", "units", "lru", "device", "config", "model", "micro_batch_tokens",
                        "checkpoint_above_tokens", "max_lora_adapters", "max_lora_rank", "max_training_runs",
                        "full_finetune", "packing", "_finish"})

    def __init__(self, base: TPBase):
        self._base = base
        self.busy_slots: Callable[[], set[int]] = set  # set by the worker; the ranks use their samplers'
        self.on_park_busy: Callable[[int], None] | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in TPRuntime._READS:
            return getattr(self._base.local.runtime, attr)
        raise AttributeError(f"{type(self).__name__} has no {attr!r} (not a read, and not run on every rank)")

    def _run(self, method: str, *args: Any) -> Any:
        return self._base.call("runtime", method, *args)

    def create_adapter(self, spec: LoraSpec, optimizer_type: str = "adamw") -> int:
        if spec.seed is None:  # drawn here: every rank must slice the same full-size adapter
            spec = dataclasses.replace(spec, seed=secrets.randbits(63))
        return self._run("create_adapter", spec, optimizer_type)

    def delete_adapter(self, unit: int) -> None:
        self._run("delete_adapter", unit)

    def ensure_resident(self, units: set[int]) -> None:
        self._run("ensure_resident", set(units))

    def optim_step(self, unit: int, params) -> dict[str, float]:
        return self._run("optim_step", unit, params)

    def optim_steps(self, requests: list) -> list:
        """Several units' steps in one call on every rank (one broadcast and one exchange of
        outcomes for all of them, not one per unit)."""
        return self._run("optim_steps", requests)

    def forward_backward(self, requests: list[TrainRequest]) -> list:
        return self._run("forward_backward", requests)

    def export_full_state(self, unit: int):
        return self._run("export_full_state", unit)

    def import_full_state(self, unit: int, weights: dict, optimizer: dict | None) -> None:
        self._run("import_full_state", unit, _on_host(weights), None if optimizer is None else _on_host(optimizer))

    def set_steps(self, unit: int, steps: int) -> None:
        self._base.call("set_steps", unit, steps)

    def adapter_tensors(self, unit: int) -> dict[str, torch.Tensor]:
        return self._base.call("adapter_tensors", unit)

    def begin(self, requests: list[TrainRequest]) -> FbPass:
        p = self._base.call("begin", requests)
        p.runtime = self  # the worker advances a pass through its runtime: this one, on every rank
        return p

    def advance(self, quotas: list[tuple[FbPass, int]], on_done: Callable[[FbPass], None] | None = None,
                budget: int | None = None) -> None:
        """Run a chunk on every rank. ``on_done`` is called after the chunk, for each pass it
        completed (not from inside it: the callback must not run while the other ranks wait)."""
        by_id = {p.id: p for p, _ in quotas}
        done = self._base.call("advance", [(p.id, q) for p, q in quotas], budget)
        if on_done is not None:
            for i in done:
                on_done(by_id[i])


class TPSampler:
    """The :class:`Sampler` methods the worker and the engine call. Requests added are queued
    here and handed to every rank with the next :meth:`step` (with a seed drawn here when the
    client gave none, so every rank draws the same tokens)."""

    def __init__(self, base: TPBase):
        self._base = base
        self._pending: list[SampleTask] = []
        self._ids = itertools.count()

    @property
    def _local(self) -> LockstepSampler:
        return self._base.local.sampler

    @property
    def cancellations(self):
        return self._local.cancellations

    @cancellations.setter
    def cancellations(self, board) -> None:
        self._local.cancellations = board  # rank 0 reads the board and tells the others what to drop

    @property
    def inbox(self) -> list[SampleTask]:
        return list(self._pending) + list(self._local.inbox)

    @property
    def rows(self):
        return self._local.rows

    @property
    def cache(self):
        return self._local.cache

    @property
    def stats(self) -> dict:
        return self._local.stats

    @property
    def prefix(self):
        return self._local.prefix

    @property
    def snapshots(self):
        return self._local.snapshots

    def add(self, task: SampleTask) -> None:
        p = task.input.params
        if p.seed is None:
            task = dataclasses.replace(task, input=dataclasses.replace(
                task.input, params=dataclasses.replace(p, seed=secrets.randbits(63))))
        self._pending.append(task)

    def has_work(self) -> bool:
        return bool(self._pending) or self._local.has_work()

    def slots_in_use(self) -> set[int]:
        return self._local.slots_in_use() | {t.slot for t in self._pending if t.slot is not None}

    def running(self):
        return self._local.running()

    def step(self, budget_s: float = 0.05) -> list:
        tasks, self._pending = self._pending, []
        sent = []
        for t in tasks:
            tid = next(self._ids)
            self._base.local_keys_put(tid, t.key)
            sent.append((tid, t.slot, t.input, t.owner))
        try:
            return self._base.call("sample_step", sent, budget_s)
        except ParallelError:
            self._pending = [t for t in tasks if not self._local.holds(t.key)]  # failed here: let abort() report them
            raise

    def abort(self) -> list:
        keys = [t.key for t in self._pending]
        self._pending = []
        if self._base.group.healthy:
            try:
                return keys + self._base.call("sample_abort")
            except ParallelError:
                pass
        return keys + self._local.abort()  # the group is down: forget rank 0's requests here

    def fail_slot(self, slot: int, exc: Exception) -> None:
        raise RuntimeError("under tensor parallelism every rank's sampler fails its own slots")


# Options of the rank's process (:func:`tinsmith.worker.warm_up.configure_device`), not of its runtime.
RANK_DEVICE_SWITCHES = ("dependent_launches", "device_memory_fraction")


def runtime_kwargs_of(options) -> dict:
    """The :class:`TPTrainingRuntime` arguments of the worker's options (the micro-batch size
    comes later, from rank 0: :meth:`TPBase.configure`), and the rank process's device switches
    (:data:`RANK_DEVICE_SWITCHES`, taken out by :func:`configured_rank` before the runtime is built)."""
    return dict(max_lora_adapters=options.max_lora_adapters, max_lora_rank=options.max_lora_rank,
                max_training_runs=options.max_training_runs, micro_batch_tokens=options.micro_batch_tokens or 2048,
                micro_batch_seqs=options.micro_batch_seqs, gradient_checkpointing=options.gradient_checkpointing,
                packing=options.train_packing,
                **{name: getattr(options, name) for name in RANK_DEVICE_SWITCHES})



def configured_rank(device: torch.device, runtime_kwargs: dict) -> dict:
    """Apply the rank process's device switches carried in ``runtime_kwargs`` (kernels launched
    dependent on the one before, the allocator's share of the device) and return the rest: the
    runtime's own arguments."""
    rest = dict(runtime_kwargs)
    configure_device(device, dependent_launches=rest.pop("dependent_launches", True),
                     memory_fraction=rest.pop("device_memory_fraction", 1.0))
    return rest


__all__ = ["OPTION", "ServingRank", "TPBase", "TPRuntime", "TPSampler", "check_servable", "configured_rank",
           "rank_device", "runtime_kwargs_of", "start_group"]
