"""Executes engine jobs on the worker and encodes their results for the wire.

This is the one place that joins the worker (tensors) with the wire codecs, so neither the
engine nor the worker needs to know the other's formats. It runs on the worker thread.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tinsmith.api import codecs
from tinsmith.engine.scheduler import Job, Outcome
from tinsmith.errors import InvalidInputError, TinsmithError
from tinsmith.types import ForwardBackwardResult
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


class WorkerOperations:
    """The engine's ``Operations``: one method per job kind."""

    def __init__(self, worker: Worker, store=None):
        self.worker = worker
        self.store = store

    def run_batch(self, kind: str, jobs: list[Job]) -> list[Outcome]:
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
        if self.store is None:
            return
        for m in model_ids:
            try:
                self.store.touch_model(m)
            except Exception:  # bookkeeping only
                log.debug("touch_model failed for %s", m, exc_info=True)

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
