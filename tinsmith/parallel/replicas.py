"""Data parallelism for serving: every rank holds a whole replica of each base model.

``tinsmith serve --data-parallel-size M`` runs M ranks (one GPU each; gloo processes on a CPU),
driven from rank 0 like a tensor-parallel group (:mod:`tinsmith.parallel.serving`: the worker
talks to stand-ins that run each call on every rank). What the replicas share:

* **Training (LoRA).** Every replica holds the same adapters: created from the same seed (drawn
  on rank 0 when the client gave none) and stepped alike. The datums of each chunk the scheduler
  hands the worker are split over the replicas (longest first onto the replica with the fewest
  tokens, computed alike everywhere), each runs its share in its own micro-batches, and the
  per-datum logprobs are all-gathered, so every replica finishes every request exactly as one
  process would (losses, metrics and outputs from all datums). Each replica's backward leaves the
  gradient of its share; one all-reduce before the optimizer step sums them (Tinker losses are
  sums over datums), after which every replica takes the same step. The worker makes chunks M
  times larger, so a chunk still takes about one micro-batch of time per replica.
* **Sampling.** Each request runs whole on one replica: rank 0 assigns it to the replica with the
  fewest sequences outstanding, except that requests with the same adapter and the same start of
  prompt go where the first of them went (so that replica's prefix cache serves them: GRPO's
  separate requests for one prompt, the turns of one conversation) unless that replica is busier
  than the least busy by more than :data:`AFFINITY_SLACK_ROWS` sequences. Every replica decodes
  its own rows for the slice's time budget; the requests that finished (and the tokens of those
  still running, for streamed responses) are gathered to rank 0. Cancellations are read from the
  board on rank 0 and sent with the next slice.

* **Full fine-tuning** runs sharded (:mod:`tinsmith.parallel.fsdp`): each replica turns a copy of
  its base model into its FSDP2 shard of the run (fp32 master weights, gradients and AdamW state
  split over the replicas), and each chunk's datums are split as for LoRA. Sampler snapshots
  gather the whole weights to rank 0, which samples full snapshots itself; checkpoints and
  exports are written by every replica, each the tensors it owns
  (:mod:`tinsmith.parallel.sharded_save`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import secrets
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from tinsmith.checkpoints.stored_tensors import StoredTensors
from tinsmith.errors import CapacityError, InvalidInputError
from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import load_model
from tinsmith.optim import check_params_match
from tinsmith.parallel.comm import sum_grads
from tinsmith.parallel.fsdp import FsdpTrainingRuntime, load_full_shard, shard_full_model, split_datums
from tinsmith.parallel.group import ParallelError, TPGroup, guarded, portable, split_grid
from tinsmith.parallel.runtime import TPTrainingRuntime, params_match
from tinsmith.parallel.sampling import LockstepSampler, install_full_lora_weights
from tinsmith.parallel.serving import ServingRank, TPBase, TPRuntime, _on_host, _tokenizer_decoder, configured_rank
from tinsmith.parallel.shard import load_shard
from tinsmith.parallel.state import gather_full
from tinsmith.sampling.cancel import CancelBoard
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import OptimParams
from tinsmith.worker.joint_steps import step_one
from tinsmith.worker.runtime import FULL_UNIT, FbPass, TrainingRuntime, repeats_a_unit
from tinsmith.worker.trainables import Trainable, lora_tensors

OPTION = "--data-parallel-size"
AFFINITY_SLACK_ROWS = 32  # a shared prompt follows its first request unless that replica is this much busier
AFFINITY_PREFIX_TOKENS = 64  # the start of a prompt that decides where requests sharing it go
AFFINITY_ENTRIES = 4096  # prompt starts remembered (least recently used forgotten)


def gather_objects(obj: Any, group: TPGroup, what: str) -> list:
    """Every rank's ``obj``, in rank order."""
    if group.size == 1:
        return [obj]
    out: list = [None] * group.size
    guarded(group, what, lambda: dist.all_gather_object(out, obj, group=group.group))
    return out


# ----------------------------------------------------------------------------- training on one replica
class ReplicaTrainingRuntime(TrainingRuntime):
    """The training runtime of one replica: every replica holds every pass, each runs its share
    of a chunk's datums, and all of them finish each pass alike (see the module docstring)."""

    def __init__(self, model, dp: TPGroup, **kwargs):
        if kwargs.get("full_finetune"):
            raise InvalidInputError(f"full fine-tuning is not served with {OPTION} > 1 yet")
        super().__init__(model, **kwargs)
        self.dp = dp

    def advance(self, quotas: list[tuple[FbPass, int]], on_done: Callable[[FbPass], None] | None = None,
                budget: int | None = None) -> None:
        """Choose the chunk's datums as one process would (every replica chooses the same), run
        this replica's share, exchange the logprobs, then complete the passes whose datums have
        all run (``on_done`` after the exchange, not from inside it)."""
        chosen, involved = self._choose(quotas, budget)
        if not chosen:
            return
        by_id = {p.id: p for p in involved}
        prepared = {(p.id, r): prep for p in involved for r, prep in p.prepared.items()}
        mine = [chosen[i] for i in split_datums([ref.length for ref in chosen], self.dp.size)[self.dp.rank]]
        lps: dict = {}
        failed: dict[int, BaseException] = {}

        def finished(rows: list, out: dict, fails: dict[int, Exception]) -> None:
            for pid, exc in fails.items():
                failed.setdefault(pid, exc)
            lps.update(out)

        try:
            self.ensure_resident({x.unit_id for x in prepared.values() if x.unit.slot is not None})
            self._run_rows(mine, prepared, lambda pid: pid in failed, finished)
        except ParallelError:
            raise
        except Exception as exc:  # fails this chunk's passes on every replica (after the exchange)
            for p in involved:
                failed.setdefault(p.id, exc)
        sent = ({k: v.detach().cpu() for k, v in lps.items() if k[0][0] not in failed},
                {pid: portable(exc) for pid, exc in failed.items()})
        parts = gather_objects(sent, self.dp, "data-parallel logprobs all_gather")
        errors: dict[int, BaseException] = {}
        for _, fails in parts:  # the lowest rank's error names a pass's failure, alike everywhere
            for pid, exc in fails.items():
                errors.setdefault(pid, exc)
        for pid, exc in errors.items():
            if not by_id[pid].done:
                by_id[pid].fail(exc)  # type: ignore[arg-type]
        for rank, (theirs, _) in enumerate(parts):
            source = lps if rank == self.dp.rank else theirs
            for ((pid, r), d), lp in source.items():
                p = by_id[pid]
                if not p.done:
                    p.lps[(r, d)] = lp if rank == self.dp.rank else lp.to(self.device)
        for p in involved:
            if not p.done and not p.todo:
                p.complete()
                if on_done is not None:
                    on_done(p)

    def optim_step(self, unit: int, params: OptimParams) -> dict[str, float]:
        params.validate()
        tr = self.unit(unit)
        if tr.slot is not None:
            self.ensure_resident({unit})
        check_params_match(tr.optimizer_type, params)  # refused alike on every replica, before the collective
        sum_grads(tr.params, self.dp)
        return step_one(tr, params)

    def optim_steps(self, requests: list[tuple[int, OptimParams]]) -> list[dict[str, float] | Exception]:
        """Several units' steps: their gradients summed over the replicas in one all-reduce (not
        one per unit), then taken together as in one process."""
        if repeats_a_unit(requests):
            return super().optim_steps(requests)

        def sum_them(units: list[tuple[Trainable, OptimParams]]) -> None:
            # A refused step (alike on every replica) leaves its gradients this replica's, as alone.
            sum_grads([p for tr, params in units if params_match(tr, params) for p in tr.params], self.dp)

        return self._steps_together(requests, prepare=sum_them)


# ----------------------------------------------------------------------------- what every rank holds
class ReplicaFullRun:
    """One full fine-tune on one rank of a serving group: its FSDP2 shard of a whole copy of the
    base model, and the runtime over it (the engine's passes by id, as a base's).

    Whatever the group's layout (whole replicas, tensor-parallel shards, or replicas of shards),
    the run is sharded with FSDP over every rank of the group: each rank runs its share of every
    chunk's datums through the whole model, gathering one layer's weights at a time."""

    def __init__(self, base: Any, group: TPGroup, optimizer_type: str):
        p = next(base.loaded.model.parameters())
        if base.shard.size > 1:  # this rank holds a tensor-parallel shard: read the checkpoint again
            model = load_full_shard(str(base.loaded.model_dir), group, p.device, p.dtype)
        else:
            model = copy.deepcopy(base.loaded.model)
            if model.config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
            shard_full_model(model, group)
        lora = base.runtime
        # An image-text model's vision tower is frozen and whole on every rank, as for LoRA runs.
        self.runtime = FsdpTrainingRuntime(model, vision=base.loaded.vision, micro_batch_tokens=lora.micro_batch_tokens,
                                           micro_batch_seqs=lora.micro_batch_seqs,
                                           checkpoint_above_tokens=lora.checkpoint_above_tokens,
                                           gradient_checkpointing=base.gradient_checkpointing, packing=lora.packing,
                                           full_optimizer=optimizer_type)
        self.runtime.unit(FULL_UNIT).export_everywhere = False  # rank 0's exports are the ones read
        self.passes: dict[int, FbPass] = {}
        # Rank 0, during a gather for an inflight sampler: the whole model the weights go into.
        self.live: CausalLM | None = None


class ReplicaTPTrainingRuntime(ReplicaTrainingRuntime, TPTrainingRuntime):
    """A replica that is itself sharded (``--tensor-parallel-size`` > 1 too): the chunk's datums
    are split over the replicas, and within a replica every shard runs the replica's share."""


class ReplicaBase:
    """One base model on one replica: the model (whole, or this rank's shard of the replica), its
    training runtime and its sampler."""

    def __init__(self, dp: TPGroup, shard: TPGroup, device: torch.device, model_dir: str, dtype: torch.dtype,
                 runtime_kwargs: dict, sampler_kwargs: dict):
        runtime_kwargs = configured_rank(device, runtime_kwargs)
        self.shard = shard
        decoder_dir = None
        if shard.size > 1:  # as a tensor-parallel rank (serving.RankBase), with the replica's shard group
            loaded = load_shard(model_dir, shard, dtype)
            model = loaded.model.to(device)
            vision = None if loaded.vision is None else loaded.vision.to(device)
            self.loaded = dataclasses.replace(loaded, model=model, vision=vision)
            self.runtime: ReplicaTrainingRuntime = ReplicaTPTrainingRuntime(model, dp, vision=vision, **runtime_kwargs)
            self.runtime.oom_retry = False  # a split micro-batch would run on one shard only
            sampler_cls: type[Sampler] = LockstepSampler
        else:
            self.loaded = load_model(model_dir, device, dtype)
            self.runtime = ReplicaTrainingRuntime(self.loaded.model, dp, vision=self.loaded.vision, **runtime_kwargs)
            sampler_cls = Sampler
        decoder_dir = self.loaded.model_dir
        # The requests of replicas other than rank 0's carry the ids rank 0 gave them, and their
        # cancellations arrive as those ids (read by the replica's first rank).
        self.board = CancelBoard(lambda key: key)
        self.sampler = sampler_cls(self.loaded.model, _tokenizer_decoder(decoder_dir), vision=self.loaded.vision,
                                   cancellations=None if dp.rank == 0 else self.board, **sampler_kwargs)
        # Each replica's sampler holds its own requests: its own slots are the busy ones here.
        self.runtime.busy_slots = self.sampler.slots_in_use
        self.runtime.on_park_busy = self._adapter_parked
        self.passes: dict[int, FbPass] = {}
        self.max_lora_adapters = runtime_kwargs.get("max_lora_adapters", 16)
        self.gradient_checkpointing = runtime_kwargs.get("gradient_checkpointing", False)
        self.full: dict[str, ReplicaFullRun] = {}  # model_id -> its full fine-tune

    def _adapter_parked(self, slot: int) -> None:
        self.sampler.fail_slot(slot, CapacityError(
            "the LoRA adapter this inflight sampler reads was moved to host memory to make room for other "
            f"training runs (--max-lora-adapters {self.max_lora_adapters}); sample again"))

    def add_task(self, tid: int, key: Any, slot: int | None, inp, owner: str | None = None) -> None:
        if isinstance(self.sampler, LockstepSampler):  # its shards agree on cancellations by id
            self.sampler.add_agreed(tid, key, slot, inp, owner)
        else:
            self.sampler.add(SampleTask(key, slot, inp, owner))

    def finished(self, key: Any, by_id: bool) -> None:
        """The request with ``key`` was reported; ``by_id``: its key is rank 0's id (not the
        engine's own key, which only rank 0's requests carry)."""
        if isinstance(self.sampler, LockstepSampler):
            self.sampler.forget(key)
        if by_id:
            self.board.forget(key)


class ReplicaRank(ServingRank):
    OPTION = OPTION

    """:class:`ServingRank` of a data-parallel group: a whole replica on each rank, or with
    ``tp_size`` > 1 a replica sharded over each ``tp_size`` consecutive ranks (``self.tp`` is
    the whole group, which the executor's calls and the sampling reports use)."""

    def __init__(self, tp: TPGroup, device: torch.device, tp_size: int = 1):
        super().__init__(tp, device)
        if tp_size > 1:
            self.shard, self.replicas = split_grid(tp, tp_size)
        else:
            self.shard, self.replicas = TPGroup.single(), tp
        self.replica = self.replicas.rank  # this rank's replica

    def add_base(self, name: str, model_dir: str, dtype: torch.dtype, runtime_kwargs: dict,
                 sampler_kwargs: dict) -> ReplicaBase:  # type: ignore[override]
        self.bases[name] = base = ReplicaBase(self.replicas, self.shard, self.device, model_dir, dtype,
                                              runtime_kwargs, sampler_kwargs)
        return base

    def adapter_tensors(self, name: str, unit: int) -> dict[str, torch.Tensor]:
        rt = self.bases[name].runtime
        tr = rt.unit(unit)
        if self.shard.size == 1:
            return lora_tensors(tr)
        if tr.slot is not None:
            rt.ensure_resident({unit})  # its shards on the device, where the collective gathers them
        return gather_full(lora_tensors(tr), rt.shard_dims, self.shard)

    def install_lora(self, name: str, slot: int, spec, tensors: dict[str, torch.Tensor]) -> None:
        install_full_lora_weights(self.bases[name].loaded.model, slot, spec, tensors)  # this rank's shard

    def sample_step(self, name: str, tasks: list[tuple[int, int, int | None, Any, str | None]], cancelled: list[int],
                    budget_s: float) -> list:  # type: ignore[override]
        """Queue this replica's ``tasks`` ((replica, id, slot, input, owner)), drop the ``cancelled`` ids,
        and decode for ``budget_s``. On rank 0: its own finished ``(key, result)`` and the report
        of every other replica's first rank ``(replica, (finished (id, result), running (id,
        sample, tokens), counters))``."""
        base = self.bases[name]
        sampler = base.sampler
        done: list = []
        error: BaseException | None = None
        try:
            for replica, tid, slot, inp, owner in tasks:
                if replica == self.replica:
                    base.add_task(tid, self.local_keys.pop(tid, tid), slot, inp, owner)
            for tid in cancelled:
                base.board.post(tid)
            done = sampler.step(budget_s)
            for key, _ in done:
                base.finished(key, by_id=self.tp.rank != 0)
        except ParallelError:
            raise
        except Exception as exc:  # sent to every rank below: they fail the call alike, none waits for it
            error = portable(exc)
        report = None
        if error is not None:
            report = (self.replica, error)
        elif self.tp.rank != 0 and self.shard.rank == 0:
            report = (self.replica, ([(key, portable(res) if isinstance(res, BaseException) else res)
                                      for key, res in done],
                                     [(key, idx, list(tokens)) for key, idx, tokens in sampler.running()],
                                     dict(sampler.stats)))
        reports = gather_objects(report, self.tp, "data-parallel sampling all_gather")
        failure = next((r[1] for r in reports if r is not None and isinstance(r[1], BaseException)), None)
        if failure is not None:
            raise failure
        return [done, [r for r in reports if r is not None]] if self.tp.rank == 0 else []

    def sample_abort(self, name: str) -> list:
        """Every replica drops its requests; rank 0's keys (rank 0 knows the others' already)."""
        base = self.bases[name]
        keys = base.sampler.abort()
        for key in keys:
            base.finished(key, by_id=self.tp.rank != 0)
        return keys if self.tp.rank == 0 else []


def replica_rank(tp_size: int, tp: TPGroup, device: torch.device) -> ReplicaRank:
    """``make_target`` of a serving data-parallel group (bind ``tp_size`` with functools.partial)."""
    return ReplicaRank(tp, device, tp_size)


# ----------------------------------------------------------------------------- rank 0's stand-ins
class ReplicaRuntime(TPRuntime):
    """The worker's runtime of a replicated base model: calls run on every replica (adapters
    without a seed get one drawn here, so every replica draws the same); reads of state come
    from rank 0's, which every replica's equals."""


class ReplicaFullRuntime(TPRuntime):
    """The worker's runtime of a full fine-tune under data parallelism: every call runs on every
    replica's shard (see :class:`ReplicaFullRun`); reads come from rank 0's. Its checkpoints are
    written by every replica, each the tensors it owns (:mod:`tinsmith.parallel.sharded_save`)."""

    writes_sharded = True

    def state_bytes(self, unit: int) -> int:
        return self._base.local.runtime.state_bytes(unit)  # shapes: every replica's are the same

    def weights_bytes(self, unit: int) -> int:
        return self._base.local.runtime.weights_bytes(unit)

    def save_state_sharded(self, unit: int, directory: str, header: dict, what: str) -> int:
        return self._run("save_state_sharded", unit, directory, header, what)

    def save_hf_sharded(self, directory: str, base_dir: str, age_recipients: tuple[str, ...], what: str) -> int:
        return self._run("save_hf_sharded", directory, base_dir, age_recipients, what)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The whole weights, gathered from the shards into host memory on rank 0."""
        return self._run("export_weights")

    def gather_live(self, target: CausalLM) -> None:
        """The whole weights written into ``target``, a model on rank 0's device (every rank
        gathers each weight; rank 0 copies it in). ``target`` never travels: rank 0's part of the
        run holds it for the call."""
        local = self._base.local
        local.live = target
        try:
            self._base.call("gather_live")
        finally:
            local.live = None

    def import_full_state(self, unit: int, weights: Mapping, optimizer: Mapping | None) -> None:
        """A checkpoint left in its files (:class:`StoredTensors`) travels as its paths, and each
        rank reads only its rows of each tensor (the ranks share the checkpoints' filesystem, as
        sharded writes require); tensors in memory travel pickled, as for adapters."""
        def sent(tensors: Mapping) -> Mapping:
            return tensors if isinstance(tensors, StoredTensors) else _on_host(dict(tensors))

        self._run("import_full_state", unit, sent(weights), None if optimizer is None else sent(optimizer))

    def drop(self) -> None:
        """The run is unloaded: every replica frees its shard."""
        self._base.drop()


class FullRunHandle:
    """What a :class:`ReplicaFullRuntime` calls through: the group, addressing one full fine-tune."""

    def __init__(self, base: TPBase, model_id: str, optimizer_type: str):
        self.group, self.key = base.group, (base.name, model_id)
        self.local: ReplicaFullRun = base.group.call("create_full", base.name, model_id, optimizer_type)
        self.runtime = ReplicaFullRuntime(self)

    def call(self, method: str, *args: Any) -> Any:
        return self.group.call(method, self.key, *args)

    def drop(self) -> None:
        """Free every replica's shard (nothing to do once the group is down)."""
        if self.group.healthy:
            self.group.call("drop_full", *self.key)


@dataclasses.dataclass
class _Remote:
    replica: int
    key: Any
    slot: int | None
    rows: int


class ReplicaSampler:
    """The :class:`Sampler` methods the worker and the engine call, over every replica's sampler."""

    def __init__(self, base: TPBase):
        self._base = base
        self._size = base.group.world_size // base.local.shard.size  # replicas (each may be several ranks)
        self._pending: list[SampleTask] = []
        self._ids = iter(range(1 << 62))
        self._out: dict[int, _Remote] = {}  # id -> where a request runs (every replica's, rank 0's too)
        self._tid_of: dict[int, int] = {}  # id(key) -> id
        self._load = [0] * self._size  # sequences outstanding per replica
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._running: list[tuple[Any, int, list[int]]] = []  # other replicas' rows as of the last slice
        self._stats: list[Counter] = [Counter() for _ in range(self._size - 1)]
        self._cancel_version = 0

    @property
    def _local(self) -> Sampler:
        return self._base.local.sampler

    @property
    def replicas(self) -> int:
        return self._size

    @property
    def cancellations(self):
        return self._local.cancellations

    @cancellations.setter
    def cancellations(self, board) -> None:
        self._local.cancellations = board  # rank 0's requests; the others' are sent as ids

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
    def prefix(self):
        return self._local.prefix

    @property
    def snapshots(self):
        return self._local.snapshots

    @property
    def stats(self) -> Counter:
        """Every replica's counters summed (the others' as of the last slice)."""
        total = Counter(dict(self._local.stats))
        for s in self._stats:
            total.update(s)
        return total

    def add(self, task: SampleTask) -> None:
        p = task.input.params
        if p.seed is None:  # drawn here: the shards of a replica must draw the same tokens
            task = dataclasses.replace(task, input=dataclasses.replace(
                task.input, params=dataclasses.replace(p, seed=secrets.randbits(63))))
        self._pending.append(task)

    def has_work(self) -> bool:
        return bool(self._pending) or bool(self._out) or self._local.has_work()

    def slots_in_use(self) -> set[int]:
        return ({r.slot for r in self._out.values() if r.slot is not None}
                | {t.slot for t in self._pending if t.slot is not None} | self._local.slots_in_use())

    def running(self):
        yield from self._local.running()
        yield from self._running

    def _place(self, task: SampleTask) -> int:
        """The replica a request runs on (see the module docstring)."""
        least = min(range(self._size), key=lambda r: (self._load[r], r))
        prompt = np.asarray(task.input.prompt[:AFFINITY_PREFIX_TOKENS], dtype=np.int64)
        start = hashlib.blake2b(prompt.tobytes() + repr(task.slot).encode(), digest_size=16).digest()
        chosen = self._affinity.get(start)
        if chosen is None or self._load[chosen] > self._load[least] + AFFINITY_SLACK_ROWS:
            chosen = least
        self._affinity[start] = chosen
        self._affinity.move_to_end(start)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return chosen

    def _cancelled(self) -> list[int]:
        """Ids of other replicas' requests whose clients cancelled them since the last look."""
        board = self.cancellations
        if board is None or board.version == self._cancel_version:
            return []
        self._cancel_version = board.version
        return [tid for tid, r in self._out.items() if r.replica != 0 and board.wants(r.key)]

    def step(self, budget_s: float = 0.05) -> list:
        tasks, self._pending = self._pending, []
        sent = []
        for t in tasks:
            tid = next(self._ids)
            replica = self._place(t)
            rows = t.input.num_samples
            self._out[tid] = _Remote(replica, t.key, t.slot, rows)
            self._tid_of[id(t.key)] = tid
            self._load[replica] += rows
            if replica == 0:
                self._base.local_keys_put(tid, t.key)
            sent.append((replica, tid, t.slot, t.input, t.owner))
        # A failed call raises ParallelError: every request stays outstanding, for abort() to report.
        done, reports = self._base.call("sample_step", sent, self._cancelled(), budget_s)
        out = []
        for key, res in done:  # rank 0's own requests
            tid = self._tid_of.get(id(key))
            if tid is not None:
                self._retire(tid)
            out.append((key, res))
        self._running = []
        for replica, (finished, running, stats) in reports:
            self._stats[replica - 1] = Counter(stats)
            for tid, res in finished:
                r = self._retire(tid)
                if r is not None:
                    out.append((r.key, res))
            self._running += [(self._out[tid].key, idx, tokens) for tid, idx, tokens in running if tid in self._out]
        return out

    def _retire(self, tid: int) -> _Remote | None:
        r = self._out.pop(tid, None)
        if r is not None:
            self._tid_of.pop(id(r.key), None)
            self._load[r.replica] -= r.rows
        return r

    def abort(self) -> list:
        """Drop every request (the group failed or the server stops); their keys."""
        local: list = []
        if self._base.group.healthy:
            try:
                local = self._base.call("sample_abort")
            except ParallelError:
                local = self._local.abort()
        else:
            local = self._local.abort()
        # Rank 0's sampler reported its own; the rest were elsewhere, or never reached it.
        seen = {id(k) for k in local}
        keys = [t.key for t in self._pending] + [r.key for r in self._out.values() if id(r.key) not in seen]
        self._pending = []
        self._out.clear()
        self._tid_of.clear()
        self._load = [0] * self._size
        self._running = []
        return keys + local

    def fail_slot(self, slot: int, exc: Exception) -> None:
        raise RuntimeError("under data parallelism every replica's sampler fails its own slots")


__all__ = ["OPTION", "FullRunHandle", "ReplicaBase", "ReplicaFullRun", "ReplicaFullRuntime", "ReplicaRank",
           "ReplicaRuntime", "ReplicaSampler", "ReplicaTrainingRuntime", "replica_rank"]
