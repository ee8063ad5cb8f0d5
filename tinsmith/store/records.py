"""Plain immutable copies of rows: what ``Store`` hands out.

Callers never hold a database session or an ORM object, so nothing lazy-loads or goes stale
behind their back, and a record can be passed between threads freely. Every datetime is
timezone-aware UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing, with the total number of matching rows (for ``Cursor``)."""

    items: list[T]
    total: int
    offset: int
    limit: int


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    owner: str
    created_at: datetime
    last_heartbeat_at: datetime
    finished_at: datetime | None
    finish_reason: str | None
    finish_detail: str | None
    tags: list[str]
    user_metadata: dict[str, Any]
    sdk_version: str | None
    project_id: str | None
    display_name: str | None

    @property
    def is_finished(self) -> bool:
        return self.finished_at is not None


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    session_id: str | None
    model_seq_id: int | None
    owner: str
    base_model: str
    is_lora: bool
    lora_rank: int | None
    lora_config: dict[str, Any] | None
    optimizer_config: dict[str, Any]
    user_metadata: dict[str, Any]
    created_at: datetime
    last_request_at: datetime
    status: str
    corrupted: bool
    last_seq_id: int


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    owner: str
    kind: str
    model_id: str | None
    sampling_session_id: str | None
    seq_id: int | None
    payload: bytes
    payload_type: str
    submit_info: dict[str, Any] | None
    status: str
    result: bytes | None
    result_content_type: str | None
    error: str | None
    error_category: str | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    purged_at: datetime | None  # payload and result dropped after the retention time
    completion_seq: int | None = None  # place in its sampler's completion order (samples only)

    @property
    def is_finished(self) -> bool:
        return self.status in ("completed", "failed")

    @property
    def is_purged(self) -> bool:
        return self.purged_at is not None


@dataclass(frozen=True)
class ResultRecord:
    """What answering a request's future reads: who owns it, where it stands and its outcome, and
    not its payload (:meth:`tinsmith.store.Store.get_result`)."""

    request_id: str
    owner: str
    status: str
    result: bytes | None
    result_content_type: str | None
    error: str | None
    error_category: str | None
    purged_at: datetime | None

    @property
    def is_purged(self) -> bool:
        return self.purged_at is not None


@dataclass(frozen=True)
class SamplingSessionRecord:
    sampling_session_id: str
    session_id: str | None
    owner: str
    base_model: str
    model_path: str | None
    snapshot_of: str | None
    created_at: datetime


@dataclass(frozen=True)
class CustomLossRecord:
    loss_id: str
    session_id: str
    custom_loss_seq_id: int
    owner: str
    name: str
    inputs: list[Any]
    graph: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    kind: str
    name: str
    owner: str
    storage_path: str
    size_bytes: int | None
    created_at: datetime
    expires_at: datetime | None
    public: bool
    user_metadata: dict[str, Any]
    status: str

    @property
    def checkpoint_id(self) -> str:
        """``{kind}/{name}``, the id used in REST URLs."""
        return f"{self.kind}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


@dataclass(frozen=True)
class MetricPoint:
    """What a completed forward_backward or optim_step reported, at the run's optimizer step."""

    model_id: str
    owner: str
    step: int
    kind: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class RequestOutcome:
    """How a request ended, to be stored: its result, or its error (``category`` user, server or
    unknown, as the SDK reports it), and what a training request reported for its run's history."""

    request_id: str
    result: bytes | None = None
    content_type: str | None = None
    error: str | None = None
    category: str = "server"
    metric_point: MetricPoint | None = None
    started_at: datetime | None = None  # when the work left the queue and began (None: leave it as stored)


@dataclass(frozen=True)
class RunMetricRecord:
    id: int
    model_id: str
    owner: str
    step: int
    kind: str
    metrics: dict[str, Any]
    recorded_at: datetime


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds the database (``server_lease``): a server process and its last sign of life."""

    name: str
    holder: str
    host: str
    pid: int
    pid_namespace: str | None
    data_dir: str
    acquired_at: datetime
    heartbeat_at: datetime


@dataclass(frozen=True)
class CompletionRecord:
    """A finished sampling request as ``retrieve_futures`` reports it."""

    request_id: str
    status: str  # completed | failed
    result_size: int | None  # bytes of the stored result; None when failed or purged
    completion_seq: int


@dataclass(frozen=True)
class UsageRecord:
    """Tokens of one kind one API key used in one UTC hour (``bucket_start``), per base model and session."""

    owner: str
    bucket_start: datetime
    kind: str
    base_model: str
    session_id: str
    tokens: int


@dataclass(frozen=True)
class TraceEntry:
    """One request of a session, without its payload or result: what a trace export shows."""

    request_id: str
    kind: str
    status: str
    model_id: str | None
    sampling_session_id: str | None
    seq_id: int | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    error_category: str | None
    payload_bytes: int
    result_bytes: int | None
