"""The training runtime: one base model, many trainable units, batched forward/backward.

A worker call carries requests from many tenants (each names its unit: a LoRA adapter slot or
the full-model unit). Every request is validated on its own first; a bad one fails alone and
the rest still run together in shared micro-batches. Gradients accumulate in each unit's
tensors until that unit's ``optim_step``.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

from tinsmith import device_memory
from tinsmith.errors import CapacityError, InvalidInputError, NotFoundError, TinsmithError
from tinsmith.losses import LossBatch, LossSpec, resolve_loss, validate_inputs
from tinsmith.models.chunked_logprobs import DEFAULT_CHUNK_BYTES, UnembedLora, chunked_target_logprobs, rows_per_chunk
from tinsmith.models.document_attention import DocumentAttention
from tinsmith.models.layers import CausalLM, causal_attention
from tinsmith.models.lora import Segments
from tinsmith.models.vision import VisionTower
from tinsmith.optim import ADAMW
from tinsmith.transfers import to_device
from tinsmith.types import ForwardBackwardInput, ForwardBackwardResult, ImageInput, LoraSpec, OptimParams
from tinsmith.worker.activation_memory import layers_to_recompute, recomputed_layer_indices
from tinsmith.worker.batching import MicroBatch, SequenceRef, batch_tokens, build_micro_batch, plan_micro_batches
from tinsmith.worker.joint_steps import result_of, step_one, step_together
from tinsmith.worker.trainables import Trainable, attach_lora, detach_lora, full_model_trainable, lora_tensors

log = logging.getLogger(__name__)

FULL_UNIT = 0  # unit id of the whole-model trainable in full fine-tuning mode



@dataclass
class TrainRequest:
    unit: int
    input: ForwardBackwardInput


@dataclass
class _Prepared:
    """A validated request, with its datums converted to tensors once."""

    unit: Trainable
    unit_id: int
    spec: LossSpec
    config: dict
    forward_only: bool
    tokens: list[np.ndarray]
    targets: list[torch.Tensor]  # (N,) or (N, K) int64
    inputs: list[dict[str, torch.Tensor]]  # flattened float inputs per datum (a custom loss's: as declared)
    images: list[list[ImageInput]]  # per datum; positions are where their tokens start
    custom: bool = False  # a custom loss: inputs keep their shapes, the loss runs per datum


@dataclass
class FbPass:
    """One trainable unit's forward/backward requests, run over one or more :meth:`advance` calls.

    ``results`` is filled when the pass is done: per request, its result or its error.
    """

    id: int
    runtime: "TrainingRuntime"
    results: list[Union[ForwardBackwardResult, TinsmithError, Exception, None]]
    prepared: dict[int, _Prepared] = field(default_factory=dict)
    todo: deque[SequenceRef] = field(default_factory=deque)  # datums not run yet
    lps: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (request, datum) -> logprobs
    unit: Trainable | None = None
    # The unit's gradients from before the pass, taken off its parameters (no copy): the pass's
    # backward fills fresh ones; completing adds these to them, failing puts these back.
    earlier_grads: list[torch.Tensor | None] | None = None
    tokens_run: int = 0
    done: bool = False

    def pending_lengths(self, tokens: int) -> list[int]:
        """Lengths of the next datums to run, enough of them to cover ``tokens``."""
        out, total = [], 0
        for ref in self.todo:
            if total >= tokens:
                break
            out.append(ref.length)
            total += ref.length
        return out

    def complete(self) -> None:
        try:
            results = {r: self.runtime._finish(prep, [self.lps[(r, d)] for d in range(len(prep.tokens))])
                       for r, prep in self.prepared.items()}
        except TinsmithError as exc:  # a custom loss refused on the real logprobs: this pass alone
            self.fail(exc)
            return
        for r, res in results.items():
            self.results[r] = res
        if self.earlier_grads is not None and self.unit is not None:
            self.unit.merge_grads(self.earlier_grads)
        self._close()

    def fail(self, exc: Exception) -> None:
        """Put the unit's gradients back as before the pass and fail its valid requests."""
        if self.earlier_grads is not None and self.unit is not None:
            self.unit.restore_grads(self.earlier_grads)
        for r in self.prepared:
            self.results[r] = exc
        self.todo.clear()
        self._close()

    def _close(self) -> None:
        self.done = True
        self.lps.clear()
        self.earlier_grads = None


class TrainingRuntime:
    """Owns the model's trainable units and runs batched forward/backward and optimizer steps."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_lora_adapters: int = 16,
        max_lora_rank: int = 128,
        max_training_runs: int = 256,
        micro_batch_tokens: int = 16384,
        micro_batch_seqs: int = 1 << 30,
        gradient_checkpointing: bool = False,
        full_finetune: bool = False,
        full_optimizer: str = ADAMW,
        vision: VisionTower | None = None,
        logit_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        master_weights: bool = True,  # fp32 masters for a half-precision full fine-tune (see trainables)
        checkpoint_above_tokens: int | None = None,
        packing: bool = False,
    ):
        self.model = model
        self.vision = vision  # image-text models: the frozen vision tower that feeds image tokens
        self.config = model.config
        self.device = next(model.parameters()).device
        self.max_lora_adapters = max_lora_adapters  # adapters attached to the model at once
        self.max_training_runs = max_training_runs  # adapters held at all (the rest parked in host memory)
        self.max_lora_rank = max_lora_rank
        self.micro_batch_tokens = micro_batch_tokens
        self.micro_batch_seqs = micro_batch_seqs
        # Packed micro-batches (one row, documents end to end, attention per document) where the
        # model supports them; padded rows otherwise (see tinsmith.worker.batching).
        self.packing = packing and model.supports_packing
        # Out of device memory in a micro-batch: split it and run the halves (LoRA gradients are
        # copied before each backward so a half-done one can be undone). Only devices that report
        # running out (CUDA) need it; a CPU's allocator does not fail this way.
        self.oom_retry = self.device.type == "cuda"
        # Run a backward in every micro-batch that asks for gradients, of zero when every loss in
        # it was refused: a sharded model's backward runs collectives that every rank must join.
        self.backward_always = False
        # Micro-batches with more (padded) tokens than this recompute their activations in backward
        # even when gradient checkpointing is off: the memory planner sizes micro-batches for
        # activations kept whole, so a single sequence longer than a micro-batch would not fit
        # otherwise (None: only as configured). A sequence that runs out of memory is tried once
        # more with checkpointing before it is refused.
        self.checkpoint_above_tokens = checkpoint_above_tokens
        self._checkpoint_rows: set[SequenceRef] = set()
        # fp32 logits of at most this many bytes exist at once (forward and backward alike)
        self.logit_chunk_bytes = logit_chunk_bytes
        model.gradient_checkpointing = gradient_checkpointing
        self.full_finetune = full_finetune
        self.units: dict[int, Trainable] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident LoRA units, least recently used first
        self._unit_ids = itertools.count()
        self._pass_ids = itertools.count()
        self.host = torch.device("cpu")
        # Set by the worker: adapter slots that samplers are reading now (inflight samplers read a
        # training run's own slot), parked last; and what to do when one of those is parked anyway.
        self.busy_slots: Callable[[], set[int]] = set
        self.on_park_busy: Callable[[int], None] | None = None
        # Set by the worker: give back the memory idle samplers keep (bytes released), tried
        # first when a micro-batch runs out of memory.
        self.release_memory: Callable[[], int] | None = None
        if full_finetune:
            self.units[FULL_UNIT] = full_model_trainable(model, full_optimizer, master_weights)

    @property
    def sized_by_real_tokens(self) -> bool:
        """Whether micro-batches are bounded by their real tokens (packed ones), rather than rows
        times the longest. Not on hybrid models even when packed: their Gated DeltaNet layers run a
        packed row's sequences as right-padded rows, with the memory of the padded size."""
        return self.packing and not self.config.has_recurrent_state

    # ----------------------------------------------------------------------------- units
    def create_adapter(self, spec: LoraSpec, optimizer_type: str = ADAMW) -> int:
        """Allocate a LoRA slot for ``spec`` (stepped by ``optimizer_type``) and return its unit id."""
        if self.full_finetune:
            raise InvalidInputError("this model instance is a full fine-tune; it does not take LoRA adapters")
        if not (1 <= spec.rank <= self.max_lora_rank):
            raise CapacityError(f"lora_config.rank={spec.rank} is outside 1..{self.max_lora_rank} (server --max-lora-rank)")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise InvalidInputError("lora_config must train at least one of attn, mlp, unembed")
        if len(self.units) >= self.max_training_runs:
            raise CapacityError(
                f"this base model already holds {self.max_training_runs} training runs (server --max-training-runs); "
                "unload a model or finish a session first"
            )
        self._make_room(1, keep=set())
        unit = next(self._unit_ids)
        self.units[unit] = attach_lora(self.model, unit, spec, optimizer_type)
        self.lru[unit] = None
        return unit

    # ----------------------------------------------------------------------------- residency
    def _make_room(self, needed: int, keep: set[int]) -> None:
        """Park least recently used adapters until ``needed`` more can be attached."""
        while len(self.lru) + needed > self.max_lora_adapters:
            busy = self.busy_slots()
            victim = next((u for u in self.lru if u not in keep and self.units[u].slot not in busy), None)
            if victim is None:
                victim = next((u for u in self.lru if u not in keep), None)
            if victim is None:
                raise CapacityError(f"more than {self.max_lora_adapters} adapters needed at once")
            slot = self.units[victim].slot
            self.units[victim].park(self.host)
            del self.lru[victim]
            if slot in busy and self.on_park_busy is not None:
                self.on_park_busy(slot)

    def ensure_resident(self, units: set[int]) -> None:
        """Attach every adapter in ``units`` (parking others if needed) and mark them recently used."""
        missing = [u for u in units if u not in self.lru and self.units[u].slot is not None]
        if missing:
            self._make_room(len(missing), keep=units)
            for u in missing:
                self.units[u].unpark(self.device)
                self.lru[u] = None
        for u in units:
            if u in self.lru:
                self.lru.move_to_end(u)

    def delete_adapter(self, unit: int) -> None:
        if unit in self.units and self.units[unit].slot is not None:
            detach_lora(self.model, unit)
            del self.units[unit]
            self.lru.pop(unit, None)

    def unit(self, unit: int) -> Trainable:
        try:
            return self.units[unit]
        except KeyError:
            raise NotFoundError(f"no trainable unit {unit} on this model") from None

    # ----------------------------------------------------------------------------- state at full size
    # The worker saves and loads through these, so that a sharded runtime (tensor parallelism,
    # tinsmith.parallel.runtime) can gather and scatter its shards; here every tensor is whole.
    def export_full_state(self, unit: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The unit's weights and optimizer state."""
        return self.unit(unit).export_state()

    def import_full_state(self, unit: int, weights: dict[str, torch.Tensor],
                          optimizer: dict[str, torch.Tensor] | None) -> None:
        self.unit(unit).import_state(weights, optimizer)

    def set_steps(self, unit: int, steps: int) -> None:
        """The optimizer steps the unit has taken (restored from a checkpoint)."""
        self.unit(unit).steps = steps

    def adapter_tensors(self, unit: int) -> dict[str, torch.Tensor]:
        """A detached copy of a LoRA unit's weights under their PEFT-style names."""
        return lora_tensors(self.unit(unit))

    # ----------------------------------------------------------------------------- validation
    def _prepare(self, req: TrainRequest) -> _Prepared:
        unit = self.unit(req.unit)
        inp = req.input
        custom = inp.custom_loss
        if inp.loss_fn == "custom":
            if custom is None:
                raise InvalidInputError("loss_fn 'custom' needs loss_fn_config['loss_id'] naming a loss from create_custom_loss")
            spec, config = custom.spec(), {}
        else:
            spec, config = resolve_loss(inp.loss_fn, inp.loss_fn_config)
        if not inp.data:
            raise InvalidInputError("data must contain at least one datum")
        V, ctx = self.config.vocab_size, self.config.max_position_embeddings
        toks, targets, inputs = [], [], []
        for i, d in enumerate(inp.data):
            t = np.asarray(d.tokens)
            if t.ndim != 1 or t.size == 0:
                raise InvalidInputError(f"data[{i}].model_input must hold at least one token")
            if t.size > ctx:
                raise InvalidInputError(f"data[{i}].model_input has {t.size} tokens, above the model's context of {ctx}")
            if not np.issubdtype(t.dtype, np.integer) or t.min() < 0 or t.max() >= V:
                raise InvalidInputError(f"data[{i}].model_input has token ids outside [0, {V}) (vocab size {V})")
            shapes = {k: tuple(np.shape(v)) for k, v in d.loss_inputs.items()}
            tshape = shapes.get("target_tokens")
            if tshape is not None and (not tshape or tshape[0] != t.size):
                rows = tshape[0] if tshape else 0
                raise InvalidInputError(
                    f"data[{i}].loss_fn_inputs['target_tokens'] has {rows} rows but model_input has {t.size} tokens"
                )
            if custom is None:
                validate_inputs(spec, i, d.loss_inputs, shapes)
            elif "target_tokens" not in d.loss_inputs:
                raise InvalidInputError(f"data[{i}].loss_fn_inputs lacks 'target_tokens', which every loss reads")
            tgt = np.asarray(d.loss_inputs["target_tokens"])
            if not np.issubdtype(tgt.dtype, np.integer) or tgt.min() < 0 or tgt.max() >= V:
                raise InvalidInputError(f"data[{i}].loss_fn_inputs['target_tokens'] has ids outside [0, {V})")
            if custom is not None:
                datum_inputs = custom.datum_inputs(i, d.loss_inputs, tgt.shape, self.device)
                custom.check_runs(i, datum_inputs, tgt.shape, self.device)
                toks.append(t.astype(np.int64, copy=False))
                targets.append(torch.from_numpy(tgt.astype(np.int64, copy=False)))
                inputs.append(datum_inputs)
                continue
            flat = {}
            for k, v in d.loss_inputs.items():
                if k == "target_tokens" or k not in spec.required_inputs + spec.optional_inputs:
                    continue
                arr = np.asarray(v, dtype=np.float32)
                if not np.isfinite(arr).all():
                    raise InvalidInputError(f"data[{i}].loss_fn_inputs[{k!r}] contains NaN or infinite values")
                flat[k] = to_device(arr.reshape(-1), self.device)
            for k in spec.optional_inputs:  # absent optional inputs take their neutral value
                if k == "weights" and k not in flat:
                    flat[k] = torch.ones(tgt.size, dtype=torch.float32, device=self.device)
            toks.append(t.astype(np.int64, copy=False))
            targets.append(torch.from_numpy(tgt.astype(np.int64, copy=False)))
            inputs.append(flat)
        images = [list(d.images) for d in inp.data]
        if any(images) and self.vision is None:
            raise InvalidInputError("this model takes no image input")
        return _Prepared(unit, req.unit, spec, config, inp.forward_only, toks, targets, inputs, images,
                         custom is not None)

    # ----------------------------------------------------------------------------- forward/backward
    def forward_backward(self, requests: list[TrainRequest]) -> list[Union[ForwardBackwardResult, TinsmithError]]:
        """Run many requests together, to completion. Returns, per request, its result or the
        error that rejected it. (The engine uses :meth:`begin` / :meth:`advance` instead, to
        interleave large requests with other tenants' work.)"""
        by_unit: dict[int, list[int]] = {}
        for r, req in enumerate(requests):
            by_unit.setdefault(req.unit, []).append(r)
        passes = [(self.begin([requests[r] for r in idxs]), idxs) for idxs in by_unit.values()]
        while any(not p.done for p, _ in passes):
            self.advance([(p, 1 << 62) for p, _ in passes if not p.done])
        results: list[Union[ForwardBackwardResult, TinsmithError, None]] = [None] * len(requests)
        for p, idxs in passes:
            for r, res in zip(idxs, p.results):
                results[r] = res
        return results  # type: ignore[return-value]

    # ----------------------------------------------------------------------------- passes
    def begin(self, requests: list[TrainRequest]) -> FbPass:
        """Validate one unit's requests and queue their datums; nothing runs yet.

        A request that fails validation fails alone (its result is the error). The unit's
        gradients so far are taken off its parameters (no copy; one pass per unit runs at a
        time): the pass accumulates into fresh ones, and adds these to them when it completes,
        so a failure while running puts them back as they were.
        """
        if len({req.unit for req in requests}) > 1:
            raise ValueError("a forward/backward pass serves one trainable unit")
        p = FbPass(next(self._pass_ids), self, [None] * len(requests))
        for r, req in enumerate(requests):
            try:
                p.prepared[r] = self._prepare(req)
            except TinsmithError as e:
                p.results[r] = e
        for r, prep in p.prepared.items():
            p.todo.extend(SequenceRef((p.id, r), d, prep.unit.slot, len(t), needs_grad=not prep.forward_only,
                                      padded=bool(prep.images[d]))
                          for d, t in enumerate(prep.tokens))
        if p.prepared:
            p.unit = next(iter(p.prepared.values())).unit
            if p.unit.slot is not None and any(not x.forward_only for x in p.prepared.values()):
                p.earlier_grads = p.unit.take_grads()
        if not p.todo:  # every request was refused: nothing to run
            p.complete()
        return p

    def advance(self, quotas: list[tuple[FbPass, int]], on_done: Callable[[FbPass], None] | None = None,
                budget: int | None = None) -> None:
        """Run up to ``quota`` tokens of each pass's remaining datums, and at most ``budget``
        tokens in all, every pass's datums sharing micro-batches. Passes come in the order
        given (most owed first); a datum that does not fit its pass's quota waits for a later
        call, except that the first datum of a call always runs (so a datum longer than any
        quota still gets its turn). Passes beyond the resident adapter slots wait too.

        Micro-batches run smallest first, and a pass is completed (and ``on_done`` called) as
        soon as its last datum has run, so a small request does not wait for the rest of the
        call. A failure fails (and rolls back) the passes of this call not completed yet.
        """
        chosen, involved = self._choose(quotas, budget)
        if not chosen:
            return
        by_id = {p.id: p for p in involved}
        prepared = {(p.id, r): prep for p in involved for r, prep in p.prepared.items()}
        left = Counter(ref.request[0] for ref in chosen)  # datums of this call still to run, per pass

        def finished(rows: list[SequenceRef], lps: dict, failed: dict[int, Exception]) -> None:
            for pid, exc in failed.items():
                by_id[pid].fail(exc)
            for ((pid, r), d), lp in lps.items():
                if not by_id[pid].done:
                    by_id[pid].lps[(r, d)] = lp
                    left[pid] -= 1
            for pid in {ref.request[0] for ref in rows}:
                p = by_id[pid]
                if left[pid] == 0 and not p.todo and not p.done:
                    p.complete()
                    if on_done is not None:
                        on_done(p)

        try:
            self.ensure_resident({x.unit_id for x in prepared.values() if x.unit.slot is not None})
            self._run_rows(chosen, prepared, lambda pid: by_id[pid].done, finished)
        except Exception as exc:
            for p in involved:
                if not p.done:
                    p.fail(exc)

    def _choose(self, quotas: list[tuple[FbPass, int]], budget: int | None) -> tuple[list[SequenceRef], list[FbPass]]:
        """The datums one :meth:`advance` call runs (taken off their passes' queues), and the
        passes they belong to. Depends only on the passes and the arguments, so every rank of a
        group that holds the same passes chooses the same datums."""
        chosen: list[SequenceRef] = []
        involved: list[FbPass] = []
        units: set[int] = set()
        total, cap = 0, (1 << 62) if budget is None else budget
        for p, quota in quotas:
            if p.done or quota <= 0 or total >= cap:
                continue
            if p.unit.slot is not None and id(p.unit) not in units and len(units) >= self.max_lora_adapters:
                continue
            taken = 0
            while p.todo and ((taken + p.todo[0].length <= quota and total + p.todo[0].length <= cap) or not chosen):
                ref = p.todo.popleft()
                taken += ref.length
                total += ref.length
                chosen.append(ref)
            if taken:
                p.tokens_run += taken
                involved.append(p)
                if p.unit.slot is not None:
                    units.add(id(p.unit))
        return chosen, involved

    def _run_rows(self, refs: list[SequenceRef], prepared: dict, skip: Callable[[int], bool],
                  finished: Callable[[list[SequenceRef], dict, dict[int, Exception]], None]) -> None:
        """Run ``refs`` in micro-batches, smallest first; after each, ``finished(rows, logprobs,
        failed passes)``. Rows of passes that ``skip`` names (failed meanwhile) are left out. A
        micro-batch that runs out of device memory is split and run again (see
        :meth:`_after_out_of_memory`)."""
        by_real = self.sized_by_real_tokens
        groups = plan_micro_batches(refs, self.micro_batch_tokens, self.micro_batch_seqs, by_real)
        groups.sort(key=lambda rows: batch_tokens(rows, by_real))
        pending = deque(groups)
        while pending:
            rows = [s for s in pending.popleft() if not skip(s.request[0])]
            if not rows:
                continue
            mb = build_micro_batch(rows, [prepared[s.request].tokens[s.datum] for s in rows], self.device,
                                   self.packing)
            lps: dict = {}
            images = [prepared[s.request].images[s.datum] for s in mb.rows]
            out_of_memory = None
            try:
                failed = self._run_micro_batch(mb, prepared, lps, images)
            except torch.OutOfMemoryError as exc:
                if not self.oom_retry:
                    raise
                out_of_memory = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            if out_of_memory is not None:  # outside the handler: its traceback no longer holds the tensors
                del mb, lps
                refused = self._after_out_of_memory(rows, out_of_memory, pending)
                if refused is not None:
                    finished(rows, {}, {rows[0].request[0]: refused})
                continue
            finished(rows, lps, failed)

    def _after_out_of_memory(self, rows: list[SequenceRef], message: str, pending: deque) -> CapacityError | None:
        """A micro-batch ran out of device memory (nothing of it was kept): free the memory, make
        later micro-batches smaller, and run its rows again in two halves; a single sequence that
        does not fit alone fails its own request, with the size and what is free: that error is
        returned (None when the rows were queued again)."""
        gc.collect()
        released = self.release_memory() if self.release_memory is not None else 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if released > 0:
            log.warning("a training micro-batch of %d sequences ran out of device memory (%s); %d bytes that idle "
                        "samplers kept were given back: running it again as it was", len(rows), message, released)
            pending.appendleft(rows)
            return None
        if len(rows) > 1:
            size = batch_tokens(rows, self.sized_by_real_tokens)
            self.micro_batch_tokens = max(1, min(self.micro_batch_tokens, size // 2))
            log.warning("a training micro-batch of %d sequences (%d %s tokens) ran out of device memory (%s); "
                        "running it in smaller pieces, and micro-batches of at most %d tokens from now on",
                        len(rows), size, "real" if self.sized_by_real_tokens else "padded", message,
                        self.micro_batch_tokens)
            half = len(rows) // 2
            pending.appendleft(rows[half:])
            pending.appendleft(rows[:half])
            return None
        ref = rows[0]
        if ref.needs_grad and self._layers_to_recompute([ref]) < self.model.config.num_layers:
            log.warning("a sequence of %d tokens ran out of device memory (%s); running it again with its "
                        "activations recomputed in backward", ref.length, message)
            self._checkpoint_rows.add(ref)
            pending.appendleft(rows)
            return None
        self._checkpoint_rows.discard(ref)
        tried = " even with its activations recomputed in backward" if ref.needs_grad else ""
        return CapacityError(
            f"a sequence of {ref.length:,} tokens does not fit in device memory on its own{tried} ({message}; "
            f"{_free_memory(self.device)}): send shorter sequences")

    def _grads_before_backward(self, mb: MicroBatch, prepared: dict) -> list[tuple[Trainable, list]] | None:
        """The LoRA gradients the micro-batch's backward would add to, taken off their parameters
        (no copy) so that a backward that runs out of memory halfway can be undone: the backward
        fills fresh gradients, added to these after it (None when not retrying, or for the full
        model, whose hooks accumulate into fp32 masters)."""
        if not self.oom_retry:
            return None
        units = {id(prepared[r.request].unit): prepared[r.request].unit for r in mb.rows}
        if any(u.slot is None for u in units.values()):
            return None
        return [(u, u.take_grads()) for u in units.values()]

    def _run_micro_batch(self, mb: MicroBatch, prepared: dict[int, _Prepared], lps: dict,
                         images: list[list[ImageInput]]) -> dict[int, Exception]:
        """Forward (and backward) one micro-batch; fills ``lps``. Returns the passes (by id) whose
        custom loss was refused here: their loss is left out of the backward and they fail alone,
        while every other request of the micro-batch trains."""
        layers = self.model.config.num_layers
        count = self._layers_to_recompute(mb.rows) if mb.needs_grad else 0
        self.model.recomputed_layers = recomputed_layer_indices(count, layers) if count < layers else frozenset()
        always = self.model.gradient_checkpointing
        self.model.gradient_checkpointing = always or count >= layers
        try:
            failed = self._forward_backward(mb, prepared, lps, images)
        finally:
            self.model.gradient_checkpointing = always
            self.model.recomputed_layers = frozenset()
        if any(r in self._checkpoint_rows for r in mb.rows):
            # done with (a failure leaves the mark, so the row is not tried a third time)
            self._checkpoint_rows.difference_update(mb.rows)
        return failed

    def _layers_to_recompute(self, rows: list[SequenceRef]) -> int:
        """How many decoder layers recompute their activations in backward for these rows: all of
        them with ``--gradient-checkpointing`` or after the rows ran out of memory; else the fewest
        that bring a micro-batch over the planned size (a sequence longer than it) down to the
        activation memory of one of the planned size (:mod:`tinsmith.worker.activation_memory`)."""
        layers = self.model.config.num_layers
        if self.model.gradient_checkpointing or any(r in self._checkpoint_rows for r in rows):
            return layers
        width = self.model.lm_head.weight.element_size()  # the activations' dtype is the weights'
        return layers_to_recompute(self.model.config, batch_tokens(rows, self.sized_by_real_tokens),
                                   self.checkpoint_above_tokens, width)

    def _forward_backward(self, mb: MicroBatch, prepared: dict[int, _Prepared], lps: dict,
                          images: list[list[ImageInput]]) -> dict[int, Exception]:
        failed: dict[int, Exception] = {}
        positions, visual = mb.positions, None
        if any(images):
            assert self.vision is not None
            positions, visual, _ = self.vision.batch_inputs(mb.tokens, [r.length for r in mb.rows], images)
        attend = causal_attention if mb.doc_bounds is None else DocumentAttention(mb.doc_bounds)
        with torch.set_grad_enabled(mb.needs_grad):
            hidden = self.model.hidden_states(mb.tokens, positions, mb.row_segments, attend=attend, visual=visual)
            h = hidden.reshape(-1, hidden.shape[-1])  # (T, hidden) real tokens, row-major
            if mb.valid is not None:  # padded rows: pick the real tokens
                h = h.index_select(0, mb.valid)
            rows_idx, cols, elem_bounds, one_per_row = [], [], [0], True
            for i, ref in enumerate(mb.rows):
                tgt = prepared[ref.request].targets[ref.datum]
                n = tgt.shape[0]
                k = 1 if tgt.dim() == 1 else tgt.shape[1]
                one_per_row = one_per_row and k == 1
                # Built on the host and moved once below (one copy, not one per datum).
                rows_idx.append(torch.arange(mb.token_offsets[i], mb.token_offsets[i] + n, device="cpu").repeat_interleave(k))
                cols.append(tgt.reshape(-1))
                elem_bounds.append(elem_bounds[-1] + n * k)
            rows_host = torch.cat(rows_idx)
            lp = self._target_logprobs(h, mb.token_segments, to_device(rows_host, self.device), to_device(torch.cat(cols), self.device),
                                       rows_host, one_per_row)
            losses = []
            by_request: dict[int, list[int]] = {}
            for i, ref in enumerate(mb.rows):
                lps[(ref.request, ref.datum)] = lp[elem_bounds[i] : elem_bounds[i + 1]]
                by_request.setdefault(ref.request, []).append(i)
            if mb.needs_grad:
                for r, idxs in by_request.items():
                    p = prepared[r]
                    parts = [lps[(r, mb.rows[i].datum)] for i in idxs]
                    batch = self._loss_batch(p, [mb.rows[i].datum for i in idxs], parts)
                    if not p.custom:
                        losses.append(p.spec.fn(batch).loss)
                        continue
                    try:
                        losses.append(p.spec.fn(batch).loss)
                    except TinsmithError as exc:
                        failed[r[0]] = exc
                if not losses and self.backward_always:
                    losses.append(lp.sum() * 0.0)
                if losses:
                    before = self._grads_before_backward(mb, prepared)
                    try:
                        torch.stack(losses).sum().backward()
                    except BaseException:  # out of memory halfway (retried), or any other failure
                        for unit, saved in before or ():
                            unit.restore_grads(saved)
                        raise
                    for unit, taken in before or ():
                        unit.merge_grads(taken)
        for i, ref in enumerate(mb.rows):
            lps[(ref.request, ref.datum)] = lps[(ref.request, ref.datum)].detach()
        return failed

    def _target_logprobs(self, h: torch.Tensor, segs: Segments, rows: torch.Tensor, cols: torch.Tensor,
                         rows_host: torch.Tensor, one_per_row: bool = False) -> torch.Tensor:
        """log p(cols[e] | token rows[e]) for each element e, with the unembedding and the loss's
        log-softmax fused over chunks of rows: full (tokens, vocab) logits never exist.
        ``rows_host`` (``rows`` on the host) gives the chunk bounds without a device read;
        ``one_per_row``: every position has one target (none has top-k candidates)."""
        head = self.model.lm_head
        loras = [UnembedLora(w.A, w.B, w.scale, a, b)
                 for slot, a, b in segs if slot is not None and (w := head.adapters.get(slot)) is not None]
        return chunked_target_logprobs(h, head.weight, rows, cols, bias=head.bias, loras=loras,
                                       chunk_rows=rows_per_chunk(self.config.vocab_size, self.logit_chunk_bytes),
                                       rows_host=rows_host, one_per_row=one_per_row)

    def _loss_batch(self, p: _Prepared, datums: list[int], lps: list[torch.Tensor]) -> LossBatch:
        offsets = [0]
        for x in lps:
            offsets.append(offsets[-1] + x.numel())
        if p.custom:
            return LossBatch(torch.cat(lps), {}, offsets, p.config, datum_inputs=[p.inputs[d] for d in datums],
                             datum_shapes=[tuple(p.targets[d].shape) for d in datums])
        keys = p.inputs[datums[0]].keys()
        inputs = {k: torch.cat([p.inputs[d][k] for d in datums]) for k in keys}
        return LossBatch(torch.cat(lps), inputs, offsets, p.config)

    def _finish(self, p: _Prepared, lps: list[torch.Tensor]) -> ForwardBackwardResult:
        """Outputs and metrics over the whole request, from detached logprobs (micro-batching invariant)."""
        with torch.no_grad():
            out = p.spec.fn(self._loss_batch(p, list(range(len(lps))), lps))
        # One read from the device for every datum (a read each would wait on the device each time).
        flat = torch.cat([lp.reshape(-1) for lp in lps]).float()
        if out.elementwise is not None:
            flat = torch.stack((flat, out.elementwise.reshape(-1).float()))
        host = flat.cpu().numpy()
        logprobs, elementwise = (host[0], host[1]) if out.elementwise is not None else (host, None)
        outputs = []
        a = 0
        for d, lp in enumerate(lps):
            shape = tuple(p.targets[d].shape)
            b = a + lp.numel()
            fields = {"logprobs": logprobs[a:b].reshape(shape)}
            if elementwise is not None:
                fields["elementwise_loss"] = elementwise[a:b].reshape(shape)
            outputs.append(fields)
            a = b
        return ForwardBackwardResult(outputs=outputs, metrics=out.metrics)

    # ----------------------------------------------------------------------------- optimizer
    def optim_step(self, unit: int, params: OptimParams) -> dict[str, float]:
        params.validate()
        tr = self.unit(unit)
        if tr.slot is not None:
            self.ensure_resident({unit})
        return step_one(tr, params)

    def optim_steps(self, requests: list[tuple[int, OptimParams]]) -> list[dict[str, float] | Exception]:
        """Several units' optimizer steps at once (tenants stepping together): each unit's result
        is what :meth:`optim_step` would return or raise for it alone, and its weights come out
        bit-identical (:mod:`tinsmith.worker.joint_steps`). A runtime whose :meth:`optim_step`
        does more (sharded full fine-tuning) takes them one by one unless it says how to take
        them together (replicas, tensor-parallel ranks)."""
        if type(self).optim_step is not TrainingRuntime.optim_step or repeats_a_unit(requests):
            return [result_of(self.optim_step, unit, params) for unit, params in requests]
        return self._steps_together(requests)

    def _steps_together(self, requests: list[tuple[int, OptimParams]],
                        prepare: Callable[[list[tuple[Trainable, OptimParams]]], None] | None = None,
                        **how) -> list:
        """:meth:`optim_steps` for distinct units; ``prepare`` sees each batch of resident units
        right before they step (a replica sums their gradients over the group there); ``how``:
        :func:`step_together`'s ``joins`` and ``norms``."""
        results: list = [None] * len(requests)
        ready: list[tuple[int, int, OptimParams]] = []
        for i, (unit, params) in enumerate(requests):
            try:
                params.validate()
                self.unit(unit)
            except TinsmithError as exc:
                results[i] = exc
                continue
            ready.append((i, unit, params))
        # As many adapters at a time as can be resident together (usually all of them).
        per = max(1, self.max_lora_adapters)
        for at in range(0, len(ready), per):
            part = ready[at:at + per]
            self.ensure_resident({u for _, u, _ in part if self.units[u].slot is not None})
            units, hps = [self.units[u] for _, u, _ in part], [p for _, _, p in part]
            if prepare is not None:
                prepare(list(zip(units, hps)))
            for (i, _, _), r in zip(part, step_together(units, hps, **how)):
                results[i] = r
        return results

    def has_pending_grads(self, unit: int) -> bool:
        return self.unit(unit).has_grads()


def repeats_a_unit(requests: list[tuple[int, OptimParams]]) -> bool:
    """Whether a unit is asked to step twice (its steps then go in order, one by one)."""
    return len({unit for unit, _ in requests}) < len(requests)


def _free_memory(device: torch.device) -> str:
    """What the device has free, for messages."""
    if device.type != "cuda":
        return f"device {device}"
    free, total = device_memory.free_and_total(device)
    share = "" if device_memory.cap(device) is None else " (this server's share, --device-memory-fraction)"
    return f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB{share} on {device}"
