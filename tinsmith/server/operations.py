"""Executes engine jobs on the worker and encodes their results for the wire.

This is the one place that joins the worker (tensors) with the wire codecs, so neither the
engine nor the worker needs to know the other's formats. It runs on the worker thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tinsmith.api import codecs
from tinsmith.engine.scheduler import Job, Outcome
from tinsmith.errors import CapacityError, ConflictError, InvalidInputError, TinsmithError
from tinsmith.checkpoints.age_encryption import parse_recipients
from tinsmith.checkpoints.export import hf_model_bytes, save_hf_model
from tinsmith.checkpoints.peft_format import adapter_bytes, save_peft_adapter
from tinsmith.checkpoints.state_format import load_training_state, save_training_state, training_state_bytes
from tinsmith.sampling.cancel import CancelBoard, SampleCancelled
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.server.limits import KeyLimits
from tinsmith.server.throughput import Throughput
from tinsmith.store.records import MetricPoint
from tinsmith.server.usage import UsageMeter, session_of
from tinsmith.types import ForwardBackwardResult, SampleInput, SampleResult
from tinsmith.worker.runtime import FbPass
from tinsmith.worker.service import Worker

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


def json_outcome(obj: Any) -> Outcome:
    return Outcome(result=json.dumps(obj, allow_nan=False).encode(), content_type=JSON)


def encode_fb(result: ForwardBackwardResult, wire: str) -> Outcome:
    if wire == "protobuf":
        return Outcome(result=codecs.encode_forward_backward_output_protobuf(result), content_type=PROTOBUF)
    return json_outcome(codecs.encode_forward_backward_output_json(result))


def encode_sample(result: SampleResult, wire: str) -> Outcome:
    if wire == "protobuf":
        return Outcome(result=codecs.encode_sample_response_protobuf(result), content_type=PROTOBUF)
    if wire == "sequences":  # the OpenAI-compatible routes: sequences with their sampled top-k
        return json_outcome(codecs.encode_sample_sequences_json(result))
    return json_outcome(codecs.encode_sample_response_json(result))


@dataclass
class SampleArgs:
    """What a sample job needs besides the input: which weights, and the ids to report."""

    base_model: str
    snapshot_key: str | None  # None: the base model itself
    storage_path: str | None  # where a named snapshot can be reloaded from
    input: SampleInput
    sequence_ids: list[str]
    # Called on the worker thread after each sampling slice with (sample index, tokens so far)
    # of every sequence still decoding (streaming); the list is live: copy what you keep.
    progress: Callable[[int, list[int]], None] | None = None


@dataclass
class SamplerSaveArgs:
    """save_weights_for_sampler: an ephemeral snapshot for a new sampler, or a named, stored one."""

    sampling_session_id: str | None = None
    name: str | None = None
    tinker_path: str | None = None
    directory: Path | None = None
    expires_at: Any = None
    user_metadata: dict | None = None
    owner: str = ""
    inflight: bool = False  # kind="inflight": the sampler follows the run's live weights (no copy)


@dataclass
class SaveArgs:
    """save_weights / save_weights_external: where the checkpoint goes and its metadata."""

    kind: str  # "weights" | "external_weights"
    name: str
    tinker_path: str
    directory: Path
    owner: str
    expires_at: Any = None
    user_metadata: dict | None = None
    overwrite: bool = False
    age_recipients: tuple[str, ...] = ()  # save_weights_external: encrypt every file to these


@dataclass
class LoadArgs:
    directory: Path
    base_model: str
    with_optimizer: bool
    create: bool
    optimizer_type: str = "adamw"  # of a run created by a weights-only load


@dataclass
class TrainPass:
    """The engine's handle on one model's forward/backward jobs: those refused before running
    (stable_reinforce without its logprobs) and the worker pass running the rest."""

    refused: list[Outcome | None]
    accepted: list[int] = field(default_factory=list)
    fb: FbPass | None = None


class StabilityLog:
    """Sampler logprobs kept per sequence id (``record_stability_info``), bounded LRU."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, sequence_id: str, tokens, logprobs) -> None:
        with self._lock:
            self._data[sequence_id] = (tokens, logprobs, time.time())
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def get(self, sequence_id: str):
        with self._lock:
            return self._data.get(sequence_id)


class WorkerOperations:
    """The engine's ``Operations``: one method per job kind."""

    def __init__(self, worker: Worker, store=None, limits: KeyLimits | None = None,
                 throughput: Throughput | None = None, usage: UsageMeter | None = None):
        self.worker = worker
        self.store = store
        self.limits = limits or KeyLimits()
        self.throughput = throughput or Throughput()
        self.usage = usage
        self._sample_inbox: deque[Job] = deque()
        self._submitted = 0  # sample requests submitted, ever: a slice ends early when it grows
        # Sampling requests their clients cancelled: posted from the event loop, honoured here.
        self.cancellations = CancelBoard(key_id=lambda job: job.request_id)
        self.stability = StabilityLog()
        self._touched: dict[str, float] = {}

    # ----------------------------------------------------------------------------- forward/backward
    def train_begin(self, jobs: list[Job]) -> TrainPass:
        """Validate one model's forward/backward jobs and queue their datums on the worker."""
        tp = TrainPass([None] * len(jobs))
        accepted = []
        for i, j in enumerate(jobs):
            try:
                if j.args.loss_fn == "stable_reinforce":
                    self.fill_recorded_logprobs(j.args)
                accepted.append(i)
            except TinsmithError as e:
                tp.refused[i] = Outcome.failure(e)
        if accepted:
            tp.accepted = accepted
            tp.fb = self.worker.fb_begin(jobs[0].model_id, [jobs[i].args for i in accepted])
        return tp

    def train_advance(self, quotas: list[tuple[TrainPass, int]], budget: int,
                      on_done: Callable[[TrainPass], None] | None = None) -> list[int]:
        live = [(tp, q) for tp, q in quotas if tp.fb is not None]
        before = [tp.fb.tokens_run for tp, _ in live]
        of_fb = {id(tp.fb): tp for tp, _ in live}
        self.worker.fb_advance([(tp.fb, q) for tp, q in live], budget,
                               None if on_done is None else (lambda fb: on_done(of_fb[id(fb)])))
        ran = {id(tp): tp.fb.tokens_run - b for (tp, _), b in zip(live, before)}
        self.throughput.trained.add(sum(ran.values()))
        return [ran.get(id(tp), 0) for tp, _ in quotas]

    def train_pending(self, tp: TrainPass, tokens: int) -> list[int]:
        return [] if tp.fb is None else tp.fb.pending_lengths(tokens)

    def train_done(self, tp: TrainPass) -> bool:
        return tp.fb is None or tp.fb.done

    def train_outcomes(self, tp: TrainPass, jobs: list[Job]) -> list[Outcome]:
        outs = list(tp.refused)
        if tp.fb is not None:
            steps = self._steps(jobs[0].model_id)
            for i, res in zip(tp.accepted, tp.fb.results):
                job = jobs[i]
                if isinstance(res, Exception):
                    outs[i] = Outcome.failure(res)
                    continue
                outs[i] = encode_fb(res, job.wire)
                self._count_training(job)
                if job.kind == "forward_backward" and steps is not None:
                    outs[i] = replace(outs[i], metric_point=MetricPoint(job.model_id, job.owner, steps, job.kind,
                                                                        dict(res.metrics)))
        self._touch({j.model_id for j in jobs})
        return outs  # type: ignore[return-value]

    def _steps(self, model_id: str | None) -> int | None:
        """The run's optimizer steps so far (None if it is not held: nothing to chart against)."""
        try:
            return self.worker.steps(model_id)
        except TinsmithError:
            return None

    def _count_training(self, job: Job) -> None:
        """Charge a completed forward/forward_backward request's input tokens to its key."""
        if self.usage is None or job.internal:
            return
        try:
            base = self.worker.placement(job.model_id).base.name
        except Exception:  # the run is gone already (unloaded): still count, without its model
            base = ""
        self.usage.record(job.owner, "training", sum(len(d.tokens) for d in job.args.data), base_model=base,
                          session_id=session_of(job.model_id))

    def _count_sampling(self, job: Job, res: SampleResult) -> None:
        """Charge a completed sample's prompt (computed or cached) and generated tokens to its key."""
        if self.usage is None:
            return
        a: SampleArgs = job.args
        cached = int(res.prompt_cache_hit_tokens)
        where = dict(base_model=a.base_model, session_id=session_of(job.topic))
        self.usage.record(job.owner, "sampling_prefill", len(a.input.prompt) - cached, **where)
        self.usage.record(job.owner, "sampling_prefill_cached", cached, **where)
        self.usage.record(job.owner, "sampling_sample", sum(len(s.tokens) for s in res.sequences), **where)

    def train_chunk_tokens(self, keys: int) -> int:
        return self.worker.chunk_tokens(keys)

    def device_settle(self) -> None:
        self.worker.settle()

    def run_one(self, job: Job) -> Outcome:
        handler = getattr(self, f"_{job.kind}", None)
        if handler is None:
            raise InvalidInputError(f"request kind {job.kind!r} is not supported by this server")
        out = handler(job)
        if job.model_id:
            self._touch({job.model_id})
        return out

    def _touch(self, model_ids: set[str]) -> None:
        """Record activity (TrainingRun.last_request_time), at most once a second per run:
        it is bookkeeping, and a database write per request would sit on the hot path."""
        if self.store is None:
            return
        now = time.monotonic()
        for m in model_ids:
            if now - self._touched.get(m, -1e9) < 1.0:
                continue
            self._touched[m] = now
            try:
                self.store.touch_model(m)
            except Exception:
                log.debug("touch_model failed for %s", m, exc_info=True)

    def fill_recorded_logprobs(self, inp) -> None:
        """For stable_reinforce: use the logprobs this server recorded when it sampled each token.

        Each datum's loss-input spans walk its positions in order; a sampled span maps positions
        ``[pos, pos+length)`` to tokens ``[offset, offset+length)`` of a sampled sequence. Where
        the record exists and its tokens equal the datum's targets, its logprobs replace the
        client's ``logprobs`` input; elsewhere the client's values stay.
        """
        import numpy as np

        for d in inp.data:
            targets = d.loss_inputs.get("target_tokens")
            if targets is None or not d.loss_input_spans:
                continue
            q = d.loss_inputs.get("logprobs")
            q = np.full(len(targets), np.nan, np.float32) if q is None else np.array(q, dtype=np.float32, copy=True)
            pos = 0
            for span in d.loss_input_spans:
                if span.kind == "sampled":
                    rec = self.stability.get(span.sequence_id)
                    if rec is not None:
                        toks, lps, _ = rec
                        a, b = span.offset, span.offset + span.length
                        if b <= len(toks) and np.array_equal(np.asarray(targets[pos:pos + span.length]), toks[a:b]):
                            q[pos:pos + span.length] = lps[a:b]
                pos += span.length
            if not np.isnan(q).any():
                d.loss_inputs["logprobs"] = q
            elif "logprobs" not in d.loss_inputs:
                raise InvalidInputError(
                    "stable_reinforce needs sampler logprobs for every position: send loss_fn_inputs['logprobs'] or "
                    "sample with record_stability_info so the server has them"
                )

    # ----------------------------------------------------------------------------- kinds
    def _create_model(self, job: Job) -> Outcome:
        base_model, lora, optimizer = job.args
        try:
            self.worker.create_model(job.model_id, base_model, lora, owner=job.owner, optimizer_type=optimizer)
        except Exception:
            if self.store is not None:  # the run never came to life: do not list it as active
                self.store.update_model_status(job.model_id, "unloaded")
            raise
        return json_outcome({"model_id": job.model_id})

    def _optim_step(self, job: Job) -> Outcome:
        return self._stepped(job, self.worker.optim_step(job.model_id, job.args))

    def run_optim_steps(self, jobs: list[Job]) -> list[Outcome | Exception]:
        """Several runs' optim_step jobs that are ready together, taken at once
        (:meth:`WorkerService.optim_steps`: one read-back and one set of kernels for all, each run's
        result as alone): each job's outcome, or the error that refused its step."""
        got = self.worker.optim_steps([(j.model_id, j.args) for j in jobs])
        self._touch({j.model_id for j in jobs})
        return [r if isinstance(r, Exception) else self._stepped(j, r) for j, r in zip(jobs, got)]

    def _stepped(self, job: Job, metrics: dict[str, float]) -> Outcome:
        metrics = {k: float(v) for k, v in metrics.items()}
        out = json_outcome({"metrics": metrics})
        step = self.worker.steps(job.model_id) - 1  # the step just taken, as its forward_backward saw it
        return replace(out, metric_point=MetricPoint(job.model_id, job.owner, step, job.kind, metrics))

    def _unload_model(self, job: Job) -> Outcome:
        self.worker.unload_model(job.model_id)
        if self.store is not None:
            self.store.update_model_status(job.model_id, "unloaded")
        return json_outcome({"model_id": job.model_id})

    # ----------------------------------------------------------------------------- checkpoints
    def _save_weights(self, job: Job) -> Outcome:
        a: SaveArgs = job.args
        existing = self.store.get_checkpoint(job.model_id, a.kind, a.name)
        if existing is not None and not a.overwrite:
            raise ConflictError(f"checkpoint {a.tinker_path!r} already exists (pass overwrite=True to replace it)")
        replacing = existing.size_bytes if existing is not None else 0
        try:
            if self.worker.writes_sharded(job.model_id):  # every rank writes its own part, none holds it all
                self.limits.check_storage(self.store, a.owner, self.worker.sharded_state_bytes(job.model_id),
                                          replacing=replacing, what=a.tinker_path)
                size = self.worker.save_training_state_sharded(job.model_id, a.directory, a.tinker_path)
            else:
                state = self.worker.export_training_state(job.model_id)
                self.limits.check_storage(self.store, a.owner, training_state_bytes(state), replacing=replacing,
                                          what=a.tinker_path)
                size = save_training_state(a.directory, state)
        except TinsmithError:
            raise
        except OSError as e:
            raise CapacityError(f"could not write checkpoint {a.tinker_path!r}: {e.strerror or e}") from e
        self.store.put_checkpoint(job.model_id, a.kind, a.name, owner=a.owner, storage_path=str(a.directory),
                                  size_bytes=size, expires_at=a.expires_at, user_metadata=a.user_metadata,
                                  overwrite=True)
        return json_outcome({"path": a.tinker_path})

    def _save_weights_external(self, job: Job) -> Outcome:
        """A LoRA run exports a PEFT adapter, a full fine-tune a Hugging Face model directory;
        with recipients, every file is age-encrypted (``NAME.age``) before it is committed."""
        a: SaveArgs = job.args
        if self.store.get_checkpoint(job.model_id, a.kind, a.name) is not None:
            raise ConflictError(f"checkpoint {a.tinker_path!r} already exists; choose another name")
        recipients = parse_recipients(a.age_recipients)
        if self.worker.placement(job.model_id).is_lora:
            spec, tensors, base = self.worker.adapter_weights(job.model_id)
            self.limits.check_storage(self.store, a.owner, adapter_bytes(tensors), what=a.tinker_path)
            write = lambda: save_peft_adapter(a.directory, spec, tensors, base.name, recipients,  # noqa: E731
                                              text_prefix=base.config.text_prefix, family=base.config.family)
        elif self.worker.writes_sharded(job.model_id):  # every rank writes its own shard file
            self.limits.check_storage(self.store, a.owner, self.worker.sharded_weights_bytes(job.model_id),
                                      what=a.tinker_path)
            write = lambda: self.worker.save_full_weights_sharded(job.model_id, a.directory,  # noqa: E731
                                                                  a.age_recipients, a.tinker_path)
        else:
            weights, base = self.worker.full_weights(job.model_id)
            self.limits.check_storage(self.store, a.owner, hf_model_bytes(weights, base.loaded.model_dir),
                                      what=a.tinker_path)
            write = lambda: save_hf_model(a.directory, weights, base.loaded.model_dir, recipients)  # noqa: E731
        try:
            size = write()
        except OSError as e:
            raise CapacityError(f"could not write checkpoint {a.tinker_path!r}: {e.strerror or e}") from e
        self.store.put_checkpoint(job.model_id, a.kind, a.name, owner=a.owner, storage_path=str(a.directory),
                                  size_bytes=size, expires_at=a.expires_at, user_metadata=a.user_metadata)
        return json_outcome({"path": a.tinker_path, "size_bytes": size})

    def _load_weights(self, job: Job) -> Outcome:
        a: LoadArgs = job.args
        try:
            # Left in its files: a sharded run's ranks read their rows each, nothing pickled to them.
            state = load_training_state(a.directory, a.with_optimizer, stored=True)
            self.worker.load_training_state(job.model_id, a.base_model, state, create=a.create, owner=job.owner,
                                            optimizer_type=a.optimizer_type)
        except Exception:
            if a.create:  # the run never came to life: do not list it as active
                self.store.update_model_status(job.model_id, "unloaded")
            raise
        if a.create:
            self.store.update_model_status(job.model_id, "active")
        return json_outcome({"model_id": job.model_id})

    # ----------------------------------------------------------------------------- sampler weights
    def _save_weights_for_sampler(self, job: Job) -> Outcome:
        a: SamplerSaveArgs = job.args
        if a.inflight:
            self.worker.publish_inflight(job.model_id, a.sampling_session_id)
            return json_outcome({"sampling_session_id": a.sampling_session_id})
        if a.name is None:
            self.worker.snapshot(job.model_id, a.sampling_session_id, owner=job.owner,
                                 queued=self._queued_snapshot_keys())
            return json_outcome({"sampling_session_id": a.sampling_session_id})
        if self.store.get_checkpoint(job.model_id, "sampler_weights", a.name) is not None:
            # A failed future rather than an HTTP 409, which the SDK would retry for minutes.
            raise ConflictError(f"sampler weights {a.tinker_path!r} already exist; save under another name")
        if self.worker.placement(job.model_id).is_lora:
            spec, tensors, base = self.worker.adapter_weights(job.model_id)
            self.limits.check_storage(self.store, a.owner, adapter_bytes(tensors), what=a.tinker_path)
            size = save_peft_adapter(a.directory, spec, tensors, base.name, text_prefix=base.config.text_prefix,
                                     family=base.config.family)
        elif self.worker.writes_sharded(job.model_id):  # a whole Hugging Face model, each rank its shard
            self.limits.check_storage(self.store, a.owner, self.worker.sharded_weights_bytes(job.model_id),
                                      what=a.tinker_path)
            size = self.worker.save_full_weights_sharded(job.model_id, a.directory, (), a.tinker_path)
        else:  # a full fine-tune's sampler weights are a whole Hugging Face model
            weights, base = self.worker.full_weights(job.model_id)
            self.limits.check_storage(self.store, a.owner, hf_model_bytes(weights, base.loaded.model_dir),
                                      what=a.tinker_path)
            size = save_hf_model(a.directory, weights, base.loaded.model_dir)
        self.store.put_checkpoint(job.model_id, "sampler_weights", a.name, owner=a.owner, storage_path=str(a.directory),
                                  size_bytes=size, expires_at=a.expires_at, user_metadata=a.user_metadata)
        try:
            self.worker.snapshot(job.model_id, a.tinker_path, owner=job.owner, reloadable=True,
                                 queued=self._queued_snapshot_keys())
        except CapacityError as e:
            # Stored on disk, the weights are saved; a sampler loads them when memory frees up.
            log.info("sampler weights %s saved but not kept in memory: %s", a.tinker_path, e.message)
        return json_outcome({"path": a.tinker_path})

    # ----------------------------------------------------------------------------- sampling
    def sample_submit(self, job: Job) -> None:
        self._sample_inbox.append(job)
        self._submitted += 1  # (event loop) read by the slice under way: requests arrived since it began

    def sample_cancel(self, request_id: str) -> None:
        """Drop a queued or running sample job (called on the event loop): it leaves the sampler
        before its next decode step and finishes with a cancellation error."""
        self.cancellations.post(request_id)

    def sample_forget(self, request_id: str) -> None:
        """The sample job finished: a cancellation posted for it has nothing left to stop."""
        self.cancellations.forget(request_id)

    def sample_has_work(self) -> bool:
        return bool(self._sample_inbox) or any(s.has_work() for s in self.worker.samplers.values())

    def _queued_snapshot_keys(self) -> set[str]:
        """Snapshots that sample requests not yet handed to a sampler will read (in use, so kept).

        The inbox is appended to from the event loop; ``list()`` of a deque copies it atomically.
        """
        return {j.args.snapshot_key for j in list(self._sample_inbox) if j.args.snapshot_key is not None}

    def sample_abort(self) -> list[Job]:
        jobs = list(self._sample_inbox)
        self._sample_inbox.clear()
        for sampler in self.worker.samplers.values():
            jobs += sampler.abort()
        return jobs

    def _resolve_sampler(self, job: Job) -> tuple[Any, int | None] | None:
        """The sampler that runs ``job``, and the adapter slot it reads (None: no adapter); None
        when the job must wait (its full snapshot cannot be made resident while others decode)."""
        a: SampleArgs = job.args
        base = self.worker.resolve_base(a.base_model)
        if a.snapshot_key is None:
            return self.worker.sampler(base), None
        if a.snapshot_key in self.worker.inflight:
            return self.worker.live_sampler(a.snapshot_key)
        if a.snapshot_key in self.worker.snapshots:
            snap = self.worker.use_snapshot(a.snapshot_key)
        elif a.storage_path is not None:
            snap = self.worker.load_snapshot(a.snapshot_key, a.base_model, Path(a.storage_path), owner=job.owner,
                                             queued=self._queued_snapshot_keys())
        else:
            raise InvalidInputError(
                f"the weights of sampler {a.snapshot_key!r} are no longer held (evicted or lost in a restart); "
                "save them again with save_weights_and_get_sampling_client"
            )
        if snap.is_full and not self.worker.make_resident(snap):
            return None
        return self.worker.sampler(snap.base, snap), snap.slot

    @staticmethod
    def _report_progress(sampler) -> None:
        """Hand the tokens decoded so far to the jobs that asked for them (streamed responses)."""
        for job, sample_idx, tokens in sampler.running():
            report = job.args.progress
            if report is not None:
                try:
                    report(sample_idx, tokens)
                except Exception:  # a listener's failure must never stop the batch of everyone else
                    log.exception("progress report of %s failed", job.request_id)

    def sample_step(self, budget_s: float) -> list[tuple[Job, Outcome]]:
        out: list[tuple[Job, Outcome]] = []
        waiting: list[Job] = []  # their full snapshots wait for a device place; retried next step
        handed = self._submitted  # the requests submitted so far are handed over (or wait) below
        while self._sample_inbox:
            job = self._sample_inbox.popleft()
            job.started_at = time.monotonic()
            if self.cancellations.wants(job):
                out.append((job, Outcome.failure(SampleCancelled("the request was cancelled by its client"))))
                continue
            try:
                resolved = self._resolve_sampler(job)
                if resolved is None:
                    waiting.append(job)
                    continue
                sampler, slot = resolved
                sampler.cancellations = self.cancellations
                sampler.add(SampleTask(job, slot, job.args.input, owner=job.owner))
            except Exception as exc:
                out.append((job, Outcome.failure(exc)))
        self._sample_inbox.extendleft(reversed(waiting))
        self.worker.refresh_live_copies()  # decoding rows read a sharded run's newest weights, as in one process
        busy = [s for s in self.worker.samplers.values() if s.has_work()]
        # Samplers (base models, whole-weight snapshots) split the slice by the keys each serves,
        # so that a key alone on its own sampler gets no more time than each key of a shared one.
        keys = [max(1, len(_owners(s))) for s in busy] if len(busy) > 1 else [1]
        for sampler, share in zip(busy, keys):
            # Requests that arrive during the slice end it early, so that they join after a burst,
            # not after the slice (GRPO's separate requests arrive over a few hundred ms). Remote
            # samplers' ranks decide their slices together; their arrivals join at the next one.
            early = {"arrivals": lambda: self._submitted != handed} if isinstance(sampler, Sampler) else {}
            finished = sampler.step(budget_s * share / sum(keys), **early)
            self._report_progress(sampler)
            for job, res in finished:
                if job.args.snapshot_key is not None:
                    self.worker.snapshot_used(job.args.snapshot_key)
                if isinstance(res, Exception):
                    out.append((job, Outcome.failure(res)))
                    continue
                self.throughput.sampled.add(sum(len(seq.tokens) for seq in res.sequences))
                self._count_sampling(job, res)
                if job.args.input.record_stability_info:
                    for sid, seq in zip(job.args.sequence_ids, res.sequences):
                        self.stability.put(sid, seq.tokens, seq.logprobs)
                try:
                    out.append((job, encode_sample(res, job.wire)))
                except Exception as exc:
                    out.append((job, Outcome.failure(exc)))
        self.worker.drop_idle_live_samplers()
        return out


def _owners(sampler) -> set[str | None]:
    """The API keys whose requests a sampler decodes or holds queued."""
    return {row.state.task.owner for row in list(sampler.rows)} | {task.owner for task in list(sampler.inbox)}
