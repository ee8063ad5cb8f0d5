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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinsmith.api import codecs
from tinsmith.engine.scheduler import Job, Outcome
from tinsmith.errors import CapacityError, ConflictError, InvalidInputError, TinsmithError
from tinsmith.checkpoints.peft_format import save_peft_adapter
from tinsmith.checkpoints.state_format import load_training_state, save_training_state
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import ForwardBackwardResult, SampleInput, SampleResult
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
    return json_outcome(codecs.encode_sample_response_json(result))


@dataclass
class SampleArgs:
    """What a sample job needs besides the input: which weights, and the ids to report."""

    base_model: str
    snapshot_key: str | None  # None: the base model itself
    storage_path: str | None  # where a named snapshot can be reloaded from
    input: SampleInput
    sequence_ids: list[str]


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
    quota_bytes: int | None = None


@dataclass
class LoadArgs:
    directory: Path
    base_model: str
    with_optimizer: bool
    create: bool


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

    def __init__(self, worker: Worker, store=None):
        self.worker = worker
        self.store = store
        self._sample_inbox: deque[Job] = deque()
        self.stability = StabilityLog()
        self._touched: dict[str, float] = {}

    def run_batch(self, kind: str, jobs: list[Job]) -> list[Outcome]:
        for j in jobs:
            if j.args.loss_fn == "stable_reinforce":
                self.fill_recorded_logprobs(j.args)
        results = self.worker.forward_backward([(j.model_id, j.args) for j in jobs])
        outs = []
        for job, res in zip(jobs, results):
            outs.append(Outcome.failure(res) if isinstance(res, TinsmithError) else encode_fb(res, job.wire))
        self._touch({j.model_id for j in jobs})
        return outs

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
        base_model, lora = job.args
        self.worker.create_model(job.model_id, base_model, lora)
        return json_outcome({"model_id": job.model_id})

    def _optim_step(self, job: Job) -> Outcome:
        metrics = self.worker.optim_step(job.model_id, job.args)
        return json_outcome({"metrics": {k: float(v) for k, v in metrics.items()}})

    def _unload_model(self, job: Job) -> Outcome:
        self.worker.unload_model(job.model_id)
        if self.store is not None:
            self.store.update_model_status(job.model_id, "unloaded")
        return json_outcome({"model_id": job.model_id})

    # ----------------------------------------------------------------------------- checkpoints
    def _check_quota(self, a: SaveArgs) -> None:
        if a.quota_bytes is None:
            return
        used = self.store.owner_storage_bytes(a.owner)
        if used >= a.quota_bytes:
            raise CapacityError(
                f"checkpoint storage quota exceeded: {used} of {a.quota_bytes} bytes used; delete checkpoints first"
            )

    def _save_weights(self, job: Job) -> Outcome:
        a: SaveArgs = job.args
        existing = self.store.get_checkpoint(job.model_id, a.kind, a.name)
        if existing is not None and not a.overwrite:
            raise ConflictError(f"checkpoint {a.tinker_path!r} already exists (pass overwrite=True to replace it)")
        self._check_quota(a)
        try:
            state = self.worker.export_training_state(job.model_id)
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
        a: SaveArgs = job.args
        if self.store.get_checkpoint(job.model_id, a.kind, a.name) is not None:
            raise ConflictError(f"checkpoint {a.tinker_path!r} already exists; choose another name")
        self._check_quota(a)
        spec, tensors, base = self.worker.adapter_weights(job.model_id)
        try:
            size = save_peft_adapter(a.directory, spec, tensors, base.name)
        except OSError as e:
            raise CapacityError(f"could not write checkpoint {a.tinker_path!r}: {e.strerror or e}") from e
        self.store.put_checkpoint(job.model_id, a.kind, a.name, owner=a.owner, storage_path=str(a.directory),
                                  size_bytes=size, expires_at=a.expires_at, user_metadata=a.user_metadata)
        return json_outcome({"path": a.tinker_path, "size_bytes": size})

    def _load_weights(self, job: Job) -> Outcome:
        a: LoadArgs = job.args
        try:
            state = load_training_state(a.directory, a.with_optimizer)
            self.worker.load_training_state(job.model_id, a.base_model, state, create=a.create)
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
        if a.name is None:
            self.worker.snapshot(job.model_id, a.sampling_session_id)
            return json_outcome({"sampling_session_id": a.sampling_session_id})
        if self.store.get_checkpoint(job.model_id, "sampler_weights", a.name) is not None:
            # A failed future rather than an HTTP 409, which the SDK would retry for minutes.
            raise ConflictError(f"sampler weights {a.tinker_path!r} already exist; save under another name")
        spec, tensors, base = self.worker.adapter_weights(job.model_id)
        size = save_peft_adapter(a.directory, spec, tensors, base.name)
        self.store.put_checkpoint(job.model_id, "sampler_weights", a.name, owner=a.owner, storage_path=str(a.directory),
                                  size_bytes=size, expires_at=a.expires_at, user_metadata=a.user_metadata)
        self.worker.snapshot(job.model_id, a.tinker_path, reloadable=True)
        return json_outcome({"path": a.tinker_path})

    # ----------------------------------------------------------------------------- sampling
    def sample_submit(self, job: Job) -> None:
        self._sample_inbox.append(job)

    def sample_has_work(self) -> bool:
        return bool(self._sample_inbox) or any(s.has_work() for s in self.worker.samplers.values())

    def sample_abort(self) -> list[Job]:
        jobs = list(self._sample_inbox)
        self._sample_inbox.clear()
        for sampler in self.worker.samplers.values():
            jobs += sampler.abort()
        return jobs

    def _resolve_slot(self, a: SampleArgs) -> tuple[Any, int | None]:
        base = self.worker.resolve_base(a.base_model)
        if a.snapshot_key is None:
            return base, None
        if a.snapshot_key in self.worker.snapshots:
            snap = self.worker.use_snapshot(a.snapshot_key)
        elif a.storage_path is not None:
            snap = self.worker.load_snapshot(a.snapshot_key, a.base_model, Path(a.storage_path))
        else:
            raise InvalidInputError(
                f"the weights of sampler {a.snapshot_key!r} are no longer held (evicted or lost in a restart); "
                "save them again with save_weights_and_get_sampling_client"
            )
        return snap.base, snap.slot

    def sample_step(self, budget_s: float) -> list[tuple[Job, Outcome]]:
        out: list[tuple[Job, Outcome]] = []
        while self._sample_inbox:
            job = self._sample_inbox.popleft()
            try:
                base, slot = self._resolve_slot(job.args)
                self.worker.sampler(base).add(SampleTask(job, slot, job.args.input))
            except Exception as exc:
                out.append((job, Outcome.failure(exc)))
        busy = [s for s in self.worker.samplers.values() if s.has_work()]
        for sampler in busy:
            for job, res in sampler.step(budget_s / len(busy)):
                if isinstance(res, Exception):
                    out.append((job, Outcome.failure(res)))
                    continue
                if job.args.input.record_stability_info:
                    for sid, seq in zip(job.args.sequence_ids, res.sequences):
                        self.stability.put(sid, seq.tokens, seq.logprobs)
                try:
                    out.append((job, encode_sample(res, job.wire)))
                except Exception as exc:
                    out.append((job, Outcome.failure(exc)))
        return out
