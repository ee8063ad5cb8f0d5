"""Declarative tables of the durable record.

The schema itself is created by the Alembic migrations in ``migrations/versions``; these
classes must stay in step with them (``tests/store`` compares the two on every backend).

No foreign keys on purpose: the API, the engine and ``copy_weights`` create rows in orders we
do not want to constrain (a ``create_model`` request exists before its model row, an imported
checkpoint may have no live run). Integrity is kept by the callers and by the unique keys.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names, so a migration written for one backend names things the
# same way on the other (and later migrations can drop them by name).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

REQUEST_STATUSES = ("pending", "running", "completed", "failed")
MODEL_STATUSES = ("active", "unloaded", "lost")
CHECKPOINT_KINDS = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_STATUSES = ("pending", "ready", "failed")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite has no time zones: values are stored as naive UTC and get ``tzinfo=UTC`` back on
    load, so callers always compare aware datetimes. Naive input is rejected rather than
    guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[str]: JSON()}


class SessionTable(Base):
    """One ``ServiceClient`` session (``create_session`` .. ``finish``)."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    finish_reason: Mapped[str | None] = mapped_column(String)
    finish_detail: Mapped[str | None] = mapped_column(Text)
    tags: Mapped[list[str]]
    user_metadata: Mapped[dict[str, Any]]
    sdk_version: Mapped[str | None] = mapped_column(String)
    project_id: Mapped[str | None] = mapped_column(String)
    display_name: Mapped[str | None] = mapped_column(String)

    __table_args__ = (
        Index(None, "owner", "created_at"),
        # The sweeper's expiry queries: unfinished sessions by last heartbeat.
        Index(None, "finished_at", "last_heartbeat_at"),
    )


class ModelTable(Base):
    """A training run: one LoRA adapter (or full fine-tune) of a base model."""

    __tablename__ = "models"

    model_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(String, index=True)
    model_seq_id: Mapped[int | None] = mapped_column(Integer)
    owner: Mapped[str] = mapped_column(String)
    base_model: Mapped[str] = mapped_column(String)
    is_lora: Mapped[bool] = mapped_column(Boolean)
    lora_rank: Mapped[int | None] = mapped_column(Integer)
    lora_config: Mapped[dict[str, Any] | None]
    optimizer_config: Mapped[dict[str, Any]]
    user_metadata: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    last_request_at: Mapped[datetime]
    status: Mapped[str] = mapped_column(String)
    corrupted: Mapped[bool] = mapped_column(Boolean)
    last_seq_id: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint(_in("status", MODEL_STATUSES), name="status"),
        Index(None, "owner", "created_at"),
        Index(None, "status"),
        # The dashboard's run lists, most recently active first: one owner's, and everyone's.
        Index(None, "owner", "last_request_at"),
        Index(None, "last_request_at"),
    )


class RequestTable(Base):
    """A future: the raw request as received, then its outcome.

    At most one request per ``(model_id, seq_id)`` and per ``(sampling_session_id, seq_id)``:
    a resubmission of the same sequence number is the same request. NULLs never collide in
    these unique keys (SQLite and PostgreSQL agree), so requests without an ordering key are
    unconstrained.
    """

    __tablename__ = "requests"

    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String)
    model_id: Mapped[str | None] = mapped_column(String)
    sampling_session_id: Mapped[str | None] = mapped_column(String)
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    payload_type: Mapped[str] = mapped_column(String)
    submit_info: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String)
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    result_content_type: Mapped[str | None] = mapped_column(String)
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    # Set when the payload and result were dropped after the retention time; the rest stays.
    purged_at: Mapped[datetime | None]
    # A sampling request's place in its sampler's completion order (retrieve_futures cursors).
    completion_seq: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("model_id", "seq_id"),
        UniqueConstraint("sampling_session_id", "seq_id"),
        CheckConstraint(_in("status", REQUEST_STATUSES), name="status"),
        Index(None, "status", "created_at"),
        Index(None, "completed_at"),
        # The retention sweep: finished requests not purged yet, oldest first.
        Index(None, "purged_at", "completed_at"),
        Index(None, "sampling_session_id", "completion_seq"),
    )


class SamplingSessionTable(Base):
    """A sampler: a base model, optionally with frozen sampler weights (``model_path``)."""

    __tablename__ = "sampling_sessions"

    sampling_session_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(String, index=True)
    owner: Mapped[str] = mapped_column(String)
    base_model: Mapped[str] = mapped_column(String)
    model_path: Mapped[str | None] = mapped_column(String)
    # The training run whose weights were frozen in memory for this sampler
    # (save_weights_and_get_sampling_client); None for base-model and model_path samplers.
    snapshot_of: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[datetime]
    # Counters handed out atomically: join_sampling_session's client_counter (0 is the
    # original client) and sampled-sequence numbers.
    next_client_counter: Mapped[int] = mapped_column(Integer)
    next_sequence_number: Mapped[int] = mapped_column(BigInteger)
    # How many of its requests have finished: the last completion_seq handed out.
    completions: Mapped[int] = mapped_column(BigInteger, server_default="0")


class CustomLossTable(Base):
    """A custom loss uploaded with ``create_custom_loss``: the SDK's encoded torch.fx graph,
    kept as sent (the server decodes it against its allow-list whenever it loads it)."""

    __tablename__ = "custom_losses"

    loss_id: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(String)
    custom_loss_seq_id: Mapped[int] = mapped_column(BigInteger)
    owner: Mapped[str] = mapped_column(String)
    name: Mapped[str] = mapped_column(String)
    inputs: Mapped[list[Any]] = mapped_column(JSON)
    graph: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]

    __table_args__ = (UniqueConstraint("session_id", "custom_loss_seq_id"),)


class CheckpointTable(Base):
    """A saved checkpoint, addressed as ``tinker://{run_id}/{kind}/{name}``."""

    __tablename__ = "checkpoints"

    run_id: Mapped[str] = mapped_column(String, primary_key=True)
    kind: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str] = mapped_column(String)
    storage_path: Mapped[str] = mapped_column(String)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]
    public: Mapped[bool] = mapped_column(Boolean)
    user_metadata: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String)

    __table_args__ = (
        CheckConstraint(_in("kind", CHECKPOINT_KINDS), name="kind"),
        CheckConstraint(_in("status", CHECKPOINT_STATUSES), name="status"),
        Index(None, "owner", "created_at"),
        Index(None, "expires_at"),
    )


class RunMetricTable(Base):
    """One point of a training run's metric history: the ``metrics`` of a completed
    forward_backward or optim_step, at the run's optimizer step (what the dashboard charts).

    Written in the transaction that stores the request's result. Bounded per run: the sweeper
    thins the older half of a run's points once it has more than its cap (``Store.thin_run_metrics``).
    """

    __tablename__ = "run_metrics"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    model_id: Mapped[str] = mapped_column(String)
    owner: Mapped[str] = mapped_column(String)
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String)  # forward_backward | optim_step
    metrics: Mapped[dict[str, Any]]
    recorded_at: Mapped[datetime]

    __table_args__ = (Index(None, "model_id", "id"),)


class UsageTable(Base):
    """Tokens one API key used in one UTC hour, by kind, base model and session.

    ``kind``: ``training`` (forward and forward_backward input tokens), ``sampling_prefill``
    (prompt tokens), ``sampling_sample`` (generated tokens). Rows are added to in batches
    (``Store.add_usage``); ``base_model`` and ``session_id`` are ``""`` where unknown.
    """

    __tablename__ = "usage"

    owner: Mapped[str] = mapped_column(String, primary_key=True)
    bucket_start: Mapped[datetime] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String, primary_key=True)
    base_model: Mapped[str] = mapped_column(String, primary_key=True)
    session_id: Mapped[str] = mapped_column(String, primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger)


class ServerLeaseTable(Base):
    """Which server process serves this database: at most one at a time.

    Servers with different data directories may share one PostgreSQL database; a file lock
    cannot see across machines, this row can. The holder renews ``heartbeat_at`` every few
    seconds; a row whose holder stopped renewing (or whose process is gone) is taken over by
    the next server to start. ``name`` keys the row (only ``"server"`` today).
    """

    __tablename__ = "server_lease"

    name: Mapped[str] = mapped_column(String, primary_key=True)
    holder: Mapped[str] = mapped_column(String)  # a fresh id per server process
    host: Mapped[str] = mapped_column(String)
    pid: Mapped[int] = mapped_column(Integer)
    # Where ``pid`` names a process (kernel boot id and pid namespace); None where unknown.
    pid_namespace: Mapped[str | None] = mapped_column(String)
    data_dir: Mapped[str] = mapped_column(String)
    acquired_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
