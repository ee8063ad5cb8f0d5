"""``Store``: every query of the durable record, in one place.

Each method runs its own short transaction and returns frozen records (``records.py``), so
callers never hold a session open. Methods are synchronous; the API may call them directly
or from a thread pool (the engine and its session factory are thread-safe).

State changes that could race (finishing a session, starting or completing a request,
advancing ``last_seq_id``, handing out counters) are single conditional UPDATE statements,
so they are atomic on SQLite and PostgreSQL alike without explicit locking. The boolean they
return says whether *this* call made the change.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Connection, Select, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tinsmith.errors import ConflictError, InvalidInputError
from tinsmith.store import connect
from tinsmith.store.ids import new_request_id, new_session_id
from tinsmith.store.records import (
    CheckpointRecord,
    CustomLossRecord,
    CompletionRecord,
    LeaseRecord,
    MetricPoint,
    ModelRecord,
    Page,
    RequestOutcome,
    RequestRecord,
    ResultRecord,
    RunMetricRecord,
    SamplingSessionRecord,
    SessionRecord,
    TraceEntry,
    UsageRecord,
)
from tinsmith.store.tables import (
    CHECKPOINT_KINDS,
    CHECKPOINT_STATUSES,
    MODEL_STATUSES,
    Base,
    CheckpointTable,
    CustomLossTable,
    ModelTable,
    RequestTable,
    RunMetricTable,
    SamplingSessionTable,
    ServerLeaseTable,
    SessionTable,
    UsageTable,
)

R = TypeVar("R")

# The two statements of storing a sample request, built once (a request's values are bound).
_INSERT_REQUEST = insert(RequestTable.__table__)
_samplers = SamplingSessionTable.__table__
_RESERVE_SEQUENCE_NUMBERS = (
    update(_samplers)
    .where(_samplers.c.sampling_session_id == bindparam("sid"))
    .values(next_sequence_number=_samplers.c.next_sequence_number + bindparam("n"))
    .returning(_samplers.c.next_sequence_number)
)

_requests = RequestTable.__table__

ERROR_CATEGORIES = ("user", "server", "unknown")
_UNFINISHED = ("pending", "running")
_FINISHED = ("completed", "failed")

# The statements of storing outcomes (``Store.finish_requests``), built once: every training
# request and every sampling slice runs them, and building them anew cost more than running them.
_UNFINISHED_OF = select(_requests.c.request_id, _requests.c.sampling_session_id).where(
    _requests.c.request_id.in_(bindparam("ids", expanding=True)), _requests.c.status.in_(_UNFINISHED))
_UNFINISHED_OF_LOCKED = _UNFINISHED_OF.with_for_update()  # PostgreSQL: what is unfinished now stays ours to finish
_COUNT_COMPLETIONS = (
    update(_samplers)
    .where(_samplers.c.sampling_session_id == bindparam("sid"))
    .values(completions=_samplers.c.completions + bindparam("n"))
    .returning(_samplers.c.completions)
)
_FINISH_REQUEST = update(_requests).where(_requests.c.request_id == bindparam("b_id")).values(
    status=bindparam("b_status"), result=bindparam("b_result"), result_content_type=bindparam("b_content_type"),
    error=bindparam("b_error"), error_category=bindparam("b_category"), completion_seq=bindparam("b_seq"),
    completed_at=bindparam("b_now", type_=_requests.c.completed_at.type),
    started_at=func.coalesce(bindparam("b_started", type_=_requests.c.started_at.type), _requests.c.started_at))
_INSERT_METRIC_POINT = insert(RunMetricTable.__table__)
# ... and of a sampler's completions (``Store.sampling_completions``), read on every poll of its futures.
_COMPLETIONS_OF = select(_samplers.c.completions).where(_samplers.c.sampling_session_id == bindparam("sid"))
_COMPLETED_BETWEEN = (
    select(_requests.c.request_id, _requests.c.status, func.length(_requests.c.result), _requests.c.completion_seq)
    .where(_requests.c.sampling_session_id == bindparam("sid"), _requests.c.completion_seq > bindparam("after"),
           _requests.c.completion_seq <= bindparam("counter"), _requests.c.seq_id >= bindparam("lo"),
           _requests.c.seq_id < bindparam("hi"))
    .order_by(_requests.c.completion_seq)
    .limit(bindparam("limit"))
)

SERVER_LEASE = "server"
SAMPLER_CACHE_ENTRIES = 4096  # sampler records kept in memory (immutable once written)
CLONE_BLOCK = 1_000_000_000  # a cloned SamplingClient's seq_ids lie in [clone * CLONE_BLOCK, (clone + 1) * CLONE_BLOCK)
USAGE_KINDS = ("training", "sampling_prefill", "sampling_prefill_cached", "sampling_sample")


def utcnow() -> datetime:
    return datetime.now(UTC)


@functools.cache
def _select_by_key(cls: type, table: type[Base]) -> Select[Any]:
    """``cls``'s fields (each a column of ``table``) of the row whose primary key columns equal
    the bound ``k0``, ``k1``, ... in the key's column order."""
    t = table.__table__
    key = [c == bindparam(f"k{i}") for i, c in enumerate(t.primary_key.columns)]
    return select(*(t.c[f.name] for f in fields(cls))).where(*key)


def _record(cls: type[R], row: Base) -> R:
    return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})  # type: ignore[arg-type]


def _aware(value: datetime | None) -> datetime | None:
    """Reject naive datetimes up front: the store compares instants, never wall-clock times."""
    if value is not None and value.utcoffset() is None:
        raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime")
    return value


def _check(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


class Store:
    """The durable record of sessions, models, requests (futures), samplers and checkpoints.

    ``url`` is a SQLAlchemy URL: ``sqlite:///path/to/tinsmith.sqlite`` (embedded default, see
    ``default_sqlite_url``) or ``postgresql+psycopg://user@host:5432/db``. Call ``migrate()``
    once at start-up before anything else. ``clock`` exists so tests can control timestamps.
    """

    def __init__(
        self, url: str, *, echo: bool = False, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.engine = connect.make_engine(url, echo=echo)
        self._sessions = sessionmaker(bind=self.engine, expire_on_commit=False)
        self._clock = clock
        # SQLite admits one writer at a time, and a writer that finds the lock taken sleeps in
        # SQLite's busy handler (1, 2, 5, 10 ... 100 ms) however soon the lock comes free: under
        # many concurrent requests (GRPO's separate samples) those sleeps, not the work, set the
        # pace. The server's threads take their turns on this lock instead, which hands over at
        # once. Other processes on the same file still meet the busy handler.
        self._turns = threading.RLock() if self.dialect == "sqlite" else contextlib.nullcontext()
        # Every asample reads its sampler's record, and nothing ever changes or deletes one (its
        # counters live outside the record), so the ones read lately are kept here.
        self._samplers: OrderedDict[str, SamplingSessionRecord] = OrderedDict()
        self._samplers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.engine.url.render_as_string(hide_password=True)!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def default_sqlite_url(data_dir: str | Path) -> str:
        """The embedded default database, ``{data_dir}/tinsmith.sqlite``."""
        return connect.default_sqlite_url(data_dir)

    @property
    def dialect(self) -> str:
        """``'sqlite'`` or ``'postgresql'``."""
        return self.engine.dialect.name

    @property
    def sqlite_path(self) -> Path | None:
        """The database file of a file-backed SQLite store; None for PostgreSQL or in-memory."""
        database = self.engine.url.database
        if self.dialect != "sqlite" or connect.is_sqlite_memory(database):
            return None
        return Path(database).expanduser().resolve()

    def migrate(self) -> None:
        """Bring the schema to the newest revision (``alembic upgrade head``); idempotent."""
        connect.run_migrations(self.engine)

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at; None before the first ``migrate()``."""
        return connect.current_revision(self.engine)

    def close(self) -> None:
        """Release every pooled connection (the Store must not be used afterwards)."""
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._turns, self._sessions.begin() as session:
            yield session

    def _update(self, stmt: Any) -> int:
        """Run one UPDATE/DELETE in its own transaction; return the number of rows matched. On a
        connection: no ORM object is involved, and the session's bookkeeping cost more than the
        statement (a sampler's result acknowledgements come here on every poll)."""
        with self._turns, self.engine.begin() as c:
            return c.execute(stmt).rowcount

    def _page(
        self, cls: type[R], query: Select[Any], order: Sequence[Any], limit: int, offset: int
    ) -> Page[R]:
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be >= 0")
        with self._tx() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = s.scalars(query.order_by(*order).limit(limit).offset(offset)).all()
            return Page([_record(cls, r) for r in rows], total, offset, limit)

    def _list(self, cls: type[R], query: Select[Any]) -> list[R]:
        with self._tx() as s:
            return [_record(cls, r) for r in s.scalars(query).all()]

    def _get(self, cls: type[R], table: type[Base], key: Any) -> R | None:
        """The record of ``table``'s row with primary key ``key`` (a tuple for a composite key).
        One prebuilt statement on a connection: every training request reads its run's record,
        and the ORM's session, identity map and object cost several times the query."""
        keys = key if isinstance(key, tuple) else (key,)
        with self._turns, self.engine.connect() as c:
            row = c.execute(_select_by_key(cls, table), {f"k{i}": k for i, k in enumerate(keys)}).first()
        return None if row is None else cls(**row._mapping)

    def _create(self, cls: type[R], row: Base, existing: Callable[[], R | None]) -> tuple[R, bool]:
        """Insert ``row``: ``(its record, True)``; when it clashes with a row already stored (a
        replayed or racing creation), ``(existing(), False)``, the winner's row being committed."""
        try:
            with self._tx() as s:
                s.add(row)
            return _record(cls, row), True
        except IntegrityError:
            found = existing()
            if found is None:
                raise
            return found, False

    # ------------------------------------------------------------------ sessions

    def create_session(
        self,
        owner: str,
        *,
        tags: Sequence[str] = (),
        user_metadata: dict[str, Any] | None = None,
        sdk_version: str | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
        session_id: str | None = None,
    ) -> SessionRecord:
        """Start a session (a fresh uuid4 id unless ``session_id`` is given)."""
        now = self._clock()
        row = SessionTable(
            session_id=session_id or new_session_id(),
            owner=owner,
            created_at=now,
            last_heartbeat_at=now,
            finished_at=None,
            finish_reason=None,
            finish_detail=None,
            tags=list(tags),
            user_metadata=dict(user_metadata or {}),
            sdk_version=sdk_version,
            project_id=project_id,
            display_name=display_name,
        )
        with self._tx() as s:
            s.add(row)
        return _record(SessionRecord, row)

    def get_session(self, session_id: str) -> SessionRecord | None:
        return self._get(SessionRecord, SessionTable, session_id)

    def heartbeat(self, session_id: str) -> bool:
        """Record a heartbeat. False when the session is unknown or finished (answer 410)."""
        stmt = (
            update(SessionTable)
            .where(SessionTable.session_id == session_id, SessionTable.finished_at.is_(None))
            .values(last_heartbeat_at=self._clock())
        )
        return self._update(stmt) > 0

    def finish_session(self, session_id: str, reason: str, detail: str | None = None) -> bool:
        """Mark the session finished. The first reason wins: later calls return False."""
        stmt = (
            update(SessionTable)
            .where(SessionTable.session_id == session_id, SessionTable.finished_at.is_(None))
            .values(finished_at=self._clock(), finish_reason=reason, finish_detail=detail)
        )
        return self._update(stmt) > 0

    def set_session_project(self, session_id: str, project_id: str | None) -> bool:
        """``PUT /sessions/{id}/project``. False when the session is unknown."""
        stmt = (
            update(SessionTable)
            .where(SessionTable.session_id == session_id)
            .values(project_id=project_id)
        )
        return self._update(stmt) > 0

    def list_sessions(self, owner: str, limit: int = 20, offset: int = 0) -> Page[SessionRecord]:
        """The owner's sessions, newest first."""
        query = select(SessionTable).where(SessionTable.owner == owner)
        order = (SessionTable.created_at.desc(), SessionTable.session_id)
        return self._page(SessionRecord, query, order, limit, offset)

    def list_stale_sessions(self, heartbeat_before: datetime) -> list[SessionRecord]:
        """Unfinished sessions whose last heartbeat is older than ``heartbeat_before``."""
        query = (
            select(SessionTable)
            .where(
                SessionTable.finished_at.is_(None),
                SessionTable.last_heartbeat_at < _aware(heartbeat_before),
            )
            .order_by(SessionTable.last_heartbeat_at, SessionTable.session_id)
        )
        return self._list(SessionRecord, query)

    def count_live_sessions(self) -> int:
        """Sessions not yet finished (closed, or timed out without a heartbeat)."""
        query = select(func.count()).select_from(SessionTable).where(SessionTable.finished_at.is_(None))
        with self._tx() as s:
            return int(s.scalar(query) or 0)

    def earliest_live_heartbeat(self) -> datetime | None:
        """The oldest last heartbeat among unfinished sessions (None when there are none).

        The session that times out next; the sweeper sleeps until then.
        """
        query = select(func.min(SessionTable.last_heartbeat_at)).where(
            SessionTable.finished_at.is_(None)
        )
        with self._tx() as s:
            return s.scalar(query)

    # ------------------------------------------------------------------ models

    def create_model(
        self,
        model_id: str,
        *,
        owner: str,
        base_model: str,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        is_lora: bool = True,
        lora_rank: int | None = None,
        lora_config: dict[str, Any] | None = None,
        optimizer_config: dict[str, Any] | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> tuple[ModelRecord, bool]:
        """Record a training run; ``model_id`` is normally ``ids.model_id_for(session, seq)``.

        Idempotent on ``model_id``: a replayed ``create_model`` gets the existing row back
        with ``created=False`` (and nothing is changed). Creation counts as sequence 0.
        """
        now = self._clock()
        row = ModelTable(
            model_id=model_id,
            session_id=session_id,
            model_seq_id=model_seq_id,
            owner=owner,
            base_model=base_model,
            is_lora=is_lora,
            lora_rank=lora_rank,
            lora_config=None if lora_config is None else dict(lora_config),
            optimizer_config=dict(optimizer_config or {"type": "adamw"}),
            user_metadata=dict(user_metadata or {}),
            created_at=now,
            last_request_at=now,
            status="active",
            corrupted=False,
            last_seq_id=0,
        )
        return self._create(ModelRecord, row, lambda: self.get_model(model_id))

    def get_model(self, model_id: str) -> ModelRecord | None:
        return self._get(ModelRecord, ModelTable, model_id)

    def list_models(
        self, owner: str, limit: int = 20, offset: int = 0, *, project_id: str | None = None
    ) -> Page[ModelRecord]:
        """The owner's training runs, newest first; optionally only those of one project."""
        query = select(ModelTable).where(ModelTable.owner == owner)
        if project_id is not None:
            query = query.join(
                SessionTable, SessionTable.session_id == ModelTable.session_id
            ).where(SessionTable.project_id == project_id)
        order = (ModelTable.created_at.desc(), ModelTable.model_id)
        return self._page(ModelRecord, query, order, limit, offset)

    def list_session_models(self, session_id: str) -> list[ModelRecord]:
        """Training runs created in one session, in creation order."""
        query = (
            select(ModelTable)
            .where(ModelTable.session_id == session_id)
            .order_by(ModelTable.created_at, ModelTable.model_id)
        )
        return self._list(ModelRecord, query)

    def list_models_by_status(self, status: str) -> list[ModelRecord]:
        """All runs in one status, any owner (for the engine, e.g. after a restart)."""
        _check(status, MODEL_STATUSES, "model status")
        query = (
            select(ModelTable)
            .where(ModelTable.status == status)
            .order_by(ModelTable.created_at, ModelTable.model_id)
        )
        return self._list(ModelRecord, query)

    def update_model_status(
        self, model_id: str, status: str, *, corrupted: bool | None = None
    ) -> bool:
        """Set active / unloaded / lost (and optionally the corrupted flag)."""
        _check(status, MODEL_STATUSES, "model status")
        values: dict[str, Any] = {"status": status}
        if corrupted is not None:
            values["corrupted"] = corrupted
        stmt = update(ModelTable).where(ModelTable.model_id == model_id).values(**values)
        return self._update(stmt) > 0

    def touch_model(self, model_id: str) -> bool:
        """Set ``last_request_at`` to now (TrainingRun.last_request_time)."""
        stmt = (
            update(ModelTable)
            .where(ModelTable.model_id == model_id)
            .values(last_request_at=self._clock())
        )
        return self._update(stmt) > 0

    def set_last_seq_id(self, model_id: str, seq_id: int) -> bool:
        """Raise ``last_seq_id`` to ``seq_id``; never lowers it. True if it moved."""
        stmt = (
            update(ModelTable)
            .where(ModelTable.model_id == model_id, ModelTable.last_seq_id < seq_id)
            .values(last_seq_id=seq_id)
        )
        return self._update(stmt) > 0

    # ------------------------------------------------------------------ requests (futures)

    def create_request(
        self,
        *,
        owner: str,
        kind: str,
        payload: bytes,
        payload_type: str,
        model_id: str | None = None,
        sampling_session_id: str | None = None,
        seq_id: int | None = None,
        submit_info: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> tuple[RequestRecord, bool]:
        """Persist a submitted request as ``pending``; returns ``(record, created)``.

        Idempotent on ``(model_id, seq_id)`` and ``(sampling_session_id, seq_id)``: a client
        retry of the same sequence number gets the existing request back (same request_id,
        ``created=False``), even when both submissions race. Training requests carry
        ``model_id`` (model creation is ``seq_id=0``), samples carry ``sampling_session_id``,
        never both. ``submit_info`` holds extra fields of the submit answer (such as
        ``sample_sequence_ids``) so a deduplicated retry is answered identically.
        """
        if seq_id is not None and model_id is not None and sampling_session_id is not None:
            raise ValueError("a request is ordered by model_id or sampling_session_id, not both")
        values = self._request_values(owner=owner, kind=kind, payload=payload, payload_type=payload_type,
                                      model_id=model_id, sampling_session_id=sampling_session_id, seq_id=seq_id,
                                      submit_info=submit_info, request_id=request_id)
        stored = self._insert_request(values)
        assert stored is not None  # nothing comes first to refuse it
        return stored

    def _insert_request(self, values: dict[str, Any],
                        first: Callable[[Connection], bool] | None = None) -> tuple[RequestRecord, bool] | None:
        """Insert a request's ``values`` in one transaction, after ``first`` (which may complete the
        values, or refuse: False stores nothing and returns None): ``(its record, True)``, or when it
        clashes with a stored request (a replay, or a racing one) ``(that request, False)``. On a
        connection, not an ORM session: every request is stored on its way in, and the session's
        bookkeeping cost more than the insert."""
        try:
            with self._turns, self.engine.begin() as c:
                if first is not None and not first(c):
                    return None
                c.execute(_INSERT_REQUEST, values)
            return RequestRecord(**values), True
        except IntegrityError:
            existing = self._find_duplicate(values)
            if existing is None:
                raise
            return existing, False

    def _request_values(self, *, owner: str, kind: str, payload: bytes, payload_type: str,
                        model_id: str | None = None, sampling_session_id: str | None = None,
                        seq_id: int | None = None, submit_info: dict[str, Any] | None = None,
                        request_id: str | None = None) -> dict[str, Any]:
        """A new request's columns, ``pending``. Inserted as a plain statement, not through the
        ORM's unit of work: a sample request is stored on the way to the sampler, and the ORM's
        object and flush were most of that write's time (docs/performance.md)."""
        return {"request_id": request_id or new_request_id(), "owner": owner, "kind": kind, "model_id": model_id,
                "sampling_session_id": sampling_session_id, "seq_id": seq_id, "payload": bytes(payload),
                "payload_type": payload_type, "submit_info": None if submit_info is None else dict(submit_info),
                "status": "pending", "result": None, "result_content_type": None, "error": None,
                "error_category": None, "created_at": self._clock(), "started_at": None, "completed_at": None,
                "purged_at": None, "completion_seq": None}

    def _find_duplicate(self, values: dict[str, Any]) -> RequestRecord | None:
        """The stored request a new one's ``values`` clashed with: the same sequence key, or id."""
        seq_id, model_id, sid = values["seq_id"], values["model_id"], values["sampling_session_id"]
        conditions: list[ColumnElement[bool]] = [RequestTable.request_id == values["request_id"]]
        if seq_id is not None and model_id is not None:
            conditions = [RequestTable.model_id == model_id, RequestTable.seq_id == seq_id]
        elif seq_id is not None and sid is not None:
            conditions = [RequestTable.sampling_session_id == sid, RequestTable.seq_id == seq_id]
        with self._tx() as s:
            found = s.scalars(select(RequestTable).where(*conditions)).first()
            return None if found is None else _record(RequestRecord, found)

    def get_request(self, request_id: str) -> RequestRecord | None:
        return self._get(RequestRecord, RequestTable, request_id)

    def get_result(self, request_id: str) -> ResultRecord | None:
        """A request's owner, status and outcome, without its payload: what ``retrieve_future``
        reads, once for every sample request whose result it hands out. One prebuilt statement
        on a connection: the ORM's session, identity map and mapped object cost several times
        the query here (0.37-0.46 against 0.07-0.12 ms of CPU on SQLite in-process)."""
        return self._get(ResultRecord, RequestTable, request_id)

    def mark_running(self, request_id: str) -> bool:
        """pending -> running. False if it was not pending (already taken or finished)."""
        stmt = (
            update(RequestTable)
            .where(RequestTable.request_id == request_id, RequestTable.status == "pending")
            .values(status="running", started_at=self._clock())
        )
        return self._update(stmt) > 0

    def requeue_request(self, request_id: str) -> bool:
        """running -> pending, e.g. when recovering work cut off by a restart."""
        stmt = (
            update(RequestTable)
            .where(RequestTable.request_id == request_id, RequestTable.status == "running")
            .values(status="pending", started_at=None)
        )
        return self._update(stmt) > 0

    def complete_request(
        self, request_id: str, result: bytes, content_type: str, metric_point: MetricPoint | None = None
    ) -> bool:
        """Store the result. The first outcome wins: False if already completed or failed.

        ``metric_point`` (what a forward_backward or optim_step reported) is recorded in the
        same transaction, only when this call completed the request: a replayed outcome adds
        no second point, and the run's history costs no extra round trip.
        """
        return self.finish_requests([RequestOutcome(request_id, result, content_type, metric_point=metric_point)])[0]

    def fail_request(self, request_id: str, error: str, category: str = "server") -> bool:
        """Store a failure (``category`` user / server / unknown, as the SDK reports it).

        The first outcome wins: False if already completed or failed.
        """
        return self.finish_requests([RequestOutcome(request_id, error=error, category=category)])[0]

    def finish_requests(self, outcomes: Sequence[RequestOutcome]) -> list[bool]:
        """Store several requests' outcomes in one transaction (the requests one sampling slice
        finished: one commit instead of one each); per request, whether this call finished it.

        The first outcome of a request wins. A sampling request also takes the next number of
        its sampler's completion order, and a training request's ``metric_point`` is added to
        its run's history (only when this call completed it: a replay adds no second point).
        The sampler's counter row stays locked until the commit, so its completions commit in
        the order of their numbers: once a reader sees the counter at N, every completion up to
        N is visible to it (what makes ``sampling_completions`` cursors safe).
        """
        for o in outcomes:
            if o.error is not None:
                _check(o.category, ERROR_CATEGORIES, "error category")
        now = self._clock()
        # Prebuilt Core statements on one connection: the ORM's session and unit of work cost
        # several times these small statements (a training step stores two outcomes), and the
        # statements run a constant number of times per sampler rather than three per request.
        with self._turns, self.engine.begin() as c:
            unfinished = _UNFINISHED_OF_LOCKED if self.dialect == "postgresql" else _UNFINISHED_OF
            sampler_of: dict[str, str | None] = {
                rid: sid for rid, sid in c.execute(unfinished, {"ids": list({o.request_id for o in outcomes})})}
            first: dict[str, RequestOutcome] = {}  # per request, the first outcome of the list
            for o in outcomes:
                if o.request_id in sampler_of:
                    first.setdefault(o.request_id, o)
            if not first:
                return [False] * len(outcomes)
            by_sampler: dict[str, list[str]] = {}
            for rid in first:
                if sampler_of[rid] is not None:
                    by_sampler.setdefault(sampler_of[rid], []).append(rid)
            completion_seq: dict[str, int] = {}
            for sid in sorted(by_sampler):  # one order everywhere: two writers never wait on each other
                rids = by_sampler[sid]
                last = c.execute(_COUNT_COMPLETIONS, {"sid": sid, "n": len(rids)}).scalar_one_or_none()
                if last is not None:
                    completion_seq.update({rid: last - len(rids) + 1 + i for i, rid in enumerate(rids)})
            c.execute(_FINISH_REQUEST, [
                {"b_id": rid, "b_status": "completed" if o.error is None else "failed",
                 "b_result": None if o.error is not None else bytes(o.result or b""),
                 "b_content_type": None if o.error is not None else o.content_type,
                 "b_error": o.error, "b_category": None if o.error is None else o.category,
                 "b_seq": completion_seq.get(rid), "b_started": _aware(o.started_at), "b_now": now}
                for rid, o in first.items()])
            points = [{"model_id": p.model_id, "owner": p.owner, "step": p.step, "kind": p.kind, "recorded_at": now,
                       "metrics": {k: (float(v) if math.isfinite(v) else None) for k, v in p.metrics.items()}}
                      for p in (o.metric_point for o in first.values() if o.error is None) if p is not None]
            if points:
                c.execute(_INSERT_METRIC_POINT, points)
        return [first.get(o.request_id) is o for o in outcomes]

    def sampling_completions(
        self, sampling_session_id: str, clone_id: int, after: int, *, limit: int = 1000
    ) -> tuple[list[CompletionRecord], int]:
        """Requests of one sampler clone that finished after cursor ``after``, in completion
        order (at most ``limit``), and the cursor that follows them.

        The cursor is a completion number of the sampler (shared by its clones): the counter
        is read first, then only completions up to it are listed, so nothing numbered at or
        below the returned cursor can still turn up later.
        """
        lo, hi = clone_id * CLONE_BLOCK, (clone_id + 1) * CLONE_BLOCK
        with self._turns, self.engine.connect() as c:  # reads alone: no ORM session needed
            counter = c.scalar(_COMPLETIONS_OF, {"sid": sampling_session_id})
            if counter is not None and after > counter:
                raise InvalidInputError(
                    f"prev_cursor {after} is ahead of sampler {sampling_session_id!r}, whose last completion is "
                    f"{counter}; pass 0 or a cursor this server returned"
                )
            if counter is None or counter == after:
                return [], after
            rows = c.execute(_COMPLETED_BETWEEN, {"sid": sampling_session_id, "after": after, "counter": counter,
                                                  "lo": lo, "hi": hi, "limit": limit}).all()
        found = [CompletionRecord(r[0], r[1], None if r[2] is None else int(r[2]), int(r[3])) for r in rows]
        cursor = found[-1].completion_seq if len(found) == limit else int(counter)
        return found, cursor

    def purge_retrieved(self, owner: str, sampling_session_id: str, request_ids: Sequence[str]) -> int:
        """Drop the payload and result of finished requests whose result the client has fetched.

        Only the owner's finished requests of that sampler are touched; other ids are ignored.
        """
        if not request_ids:
            return 0
        stmt = (
            update(RequestTable)
            .where(
                RequestTable.request_id.in_(list(request_ids)),
                RequestTable.owner == owner,
                RequestTable.sampling_session_id == sampling_session_id,
                RequestTable.status.in_(_FINISHED),
                RequestTable.purged_at.is_(None),
            )
            .values(payload=b"", result=None, purged_at=self._clock())
        )
        return self._update(stmt)

    def session_trace(self, session_id: str) -> list[TraceEntry]:
        """Every request of a session's training runs and samplers, oldest first, without payloads."""
        runs = select(ModelTable.model_id).where(ModelTable.session_id == session_id)
        samplers = select(SamplingSessionTable.sampling_session_id).where(
            SamplingSessionTable.session_id == session_id
        )
        query = (
            select(
                RequestTable.request_id, RequestTable.kind, RequestTable.status, RequestTable.model_id,
                RequestTable.sampling_session_id, RequestTable.seq_id, RequestTable.created_at,
                RequestTable.started_at, RequestTable.completed_at, RequestTable.error_category,
                func.length(RequestTable.payload), func.length(RequestTable.result),
            )
            .where(RequestTable.model_id.in_(runs) | RequestTable.sampling_session_id.in_(samplers))
            .order_by(RequestTable.created_at, RequestTable.request_id)
        )
        with self._tx() as s:
            rows = s.execute(query).all()
        return [
            TraceEntry(*r[:10], payload_bytes=int(r[10] or 0), result_bytes=None if r[11] is None else int(r[11]))
            for r in rows
        ]

    def list_unfinished_requests(self) -> list[RequestRecord]:
        """Pending and running requests, oldest first: what to re-run after a restart."""
        query = (
            select(RequestTable)
            .where(RequestTable.status.in_(_UNFINISHED))
            .order_by(RequestTable.created_at, RequestTable.seq_id, RequestTable.request_id)
        )
        return self._list(RequestRecord, query)

    def list_pending_requests(self, model_id: str) -> list[RequestRecord]:
        """A model's pending requests in ``seq_id`` order (the order they must run in)."""
        query = (
            select(RequestTable)
            .where(RequestTable.model_id == model_id, RequestTable.status == "pending")
            .order_by(RequestTable.seq_id, RequestTable.created_at)
        )
        return self._list(RequestRecord, query)

    def purge_request_payloads(self, finished_before: datetime, *, batch: int = 1000) -> int:
        """Drop the payload and result of requests finished before the cutoff; returns the count.

        Payloads and results are the bulk of the table and are only needed until the client
        has fetched the result. The record stays (id, kind, owner, status, times, error), so a
        late ``retrieve_future`` can say the result expired rather than "not found", and a
        replayed ``seq_id`` still maps to it. Works in batches of ``batch`` rows, each its own
        short transaction, so a large backlog never holds the write lock for long.
        """
        cutoff = _aware(finished_before)
        total = 0
        while True:
            due = (
                select(RequestTable.request_id)
                .where(
                    RequestTable.purged_at.is_(None),
                    RequestTable.completed_at < cutoff,
                    RequestTable.status.in_(_FINISHED),
                )
                .order_by(RequestTable.completed_at)
                .limit(batch)
            )
            stmt = (
                update(RequestTable)
                .where(RequestTable.request_id.in_(due))
                .values(payload=b"", result=None, purged_at=self._clock())
            )
            n = self._update(stmt)
            total += n
            if n < batch:
                return total

    # ------------------------------------------------------------------ custom losses

    def create_custom_loss(
        self,
        loss_id: str,
        *,
        session_id: str,
        custom_loss_seq_id: int,
        owner: str,
        name: str,
        inputs: list[Any],
        graph: dict[str, Any],
    ) -> tuple[CustomLossRecord, bool]:
        """Record an uploaded custom loss; returns ``(record, created)``.

        Idempotent on ``(session_id, custom_loss_seq_id)``, since the SDK retries the upload with
        the same sequence number; a different loss under a used number is a ConflictError.
        """
        row = CustomLossTable(
            loss_id=loss_id, session_id=session_id, custom_loss_seq_id=custom_loss_seq_id, owner=owner,
            name=name, inputs=list(inputs), graph=dict(graph), created_at=self._clock(),
        )
        try:
            with self._tx() as s:
                s.add(row)
            return _record(CustomLossRecord, row), True
        except IntegrityError:
            query = select(CustomLossTable).where(
                CustomLossTable.session_id == session_id, CustomLossTable.custom_loss_seq_id == custom_loss_seq_id
            )
            with self._tx() as s:
                found = s.scalars(query).first()
                existing = None if found is None else _record(CustomLossRecord, found)
            if existing is None:
                raise
            if (existing.name, existing.inputs, existing.graph) != (name, list(inputs), dict(graph)):
                raise ConflictError(
                    f"custom_loss_seq_id {custom_loss_seq_id} of session {session_id!r} was already used "
                    f"by loss {existing.name!r}; every create_custom_loss needs its own sequence number"
                ) from None
            return existing, False

    def get_custom_loss(self, loss_id: str) -> CustomLossRecord | None:
        return self._get(CustomLossRecord, CustomLossTable, loss_id)

    def count_session_custom_losses(self, session_id: str) -> int:
        query = select(func.count()).select_from(CustomLossTable).where(CustomLossTable.session_id == session_id)
        with self._tx() as s:
            return int(s.execute(query).scalar_one())

    # ------------------------------------------------------------------ sampling sessions

    def create_sampling_session(
        self,
        sampling_session_id: str,
        *,
        owner: str,
        base_model: str,
        session_id: str | None = None,
        model_path: str | None = None,
        snapshot_of: str | None = None,
    ) -> tuple[SamplingSessionRecord, bool]:
        """Record a sampler (id normally ``ids.sampling_session_id_for(session, seq)``).

        Idempotent on the id, since the SDK may replay the creating call.
        """
        row = SamplingSessionTable(
            sampling_session_id=sampling_session_id,
            session_id=session_id,
            owner=owner,
            base_model=base_model,
            model_path=model_path,
            snapshot_of=snapshot_of,
            created_at=self._clock(),
            next_client_counter=0,
            next_sequence_number=0,
            completions=0,
        )
        record, created = self._create(SamplingSessionRecord, row, lambda: self.get_sampling_session(sampling_session_id))
        self._remember_sampler(record)
        return record, created

    def get_sampling_session(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        cached = self.cached_sampling_session(sampling_session_id)
        if cached is not None:
            return cached
        found = self._get(SamplingSessionRecord, SamplingSessionTable, sampling_session_id)
        if found is not None:
            self._remember_sampler(found)
        return found

    def cached_sampling_session(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        """The sampler's record if it was read or written lately (no database round trip), else
        None: callers on an event loop try this before sending ``get_sampling_session`` to a thread."""
        with self._samplers_lock:
            found = self._samplers.get(sampling_session_id)
            if found is not None:
                self._samplers.move_to_end(sampling_session_id)
            return found

    def _remember_sampler(self, record: SamplingSessionRecord) -> None:
        with self._samplers_lock:
            self._samplers[record.sampling_session_id] = record
            self._samplers.move_to_end(record.sampling_session_id)
            while len(self._samplers) > SAMPLER_CACHE_ENTRIES:
                self._samplers.popitem(last=False)

    def list_session_sampling_sessions(self, session_id: str) -> list[SamplingSessionRecord]:
        """Samplers created in one session, in creation order."""
        query = (
            select(SamplingSessionTable)
            .where(SamplingSessionTable.session_id == session_id)
            .order_by(SamplingSessionTable.created_at, SamplingSessionTable.sampling_session_id)
        )
        return self._list(SamplingSessionRecord, query)

    def _bump(self, sampling_session_id: str, column: Any, by: int) -> int | None:
        stmt = (
            update(SamplingSessionTable)
            .where(SamplingSessionTable.sampling_session_id == sampling_session_id)
            .values({column: column + by})
            .returning(column)
        )
        with self._tx() as s:
            return s.execute(stmt).scalar_one_or_none()

    def join_sampling_session(self, sampling_session_id: str) -> int | None:
        """Hand out the next ``client_counter`` (1, 2, ...; 0 is the original client).

        None when the sampler is unknown.
        """
        return self._bump(sampling_session_id, SamplingSessionTable.next_client_counter, 1)

    def create_sample_request(
        self,
        *,
        owner: str,
        sampling_session_id: str,
        num_samples: int,
        payload: bytes,
        payload_type: str,
        seq_id: int | None = None,
        submit_info_for: Callable[[int], dict[str, Any]],
    ) -> tuple[RequestRecord, bool] | None:
        """``create_request`` for a sample request that also reserves ``num_samples`` consecutive
        sampled-sequence numbers of its sampler, in one transaction: a replayed request (its
        ``seq_id`` already stored: ``created=False``) reserves none. ``submit_info_for``
        makes the submit answer's fields from the first reserved number. None when the sampler
        is unknown.
        """
        if num_samples < 1:
            raise ValueError("num_samples must be >= 1")
        values = self._request_values(owner=owner, kind="sample", payload=payload, payload_type=payload_type,
                                      sampling_session_id=sampling_session_id, seq_id=seq_id)

        def reserve(c: Connection) -> bool:
            end = c.execute(_RESERVE_SEQUENCE_NUMBERS, {"sid": sampling_session_id, "n": num_samples}).scalar_one_or_none()
            if end is None:
                return False
            values["submit_info"] = submit_info_for(end - num_samples)
            return True

        return self._insert_request(values, reserve)

    # ------------------------------------------------------------------ checkpoints

    def put_checkpoint(
        self,
        run_id: str,
        kind: str,
        name: str,
        *,
        owner: str,
        storage_path: str,
        size_bytes: int | None = None,
        expires_at: datetime | None = None,
        public: bool = False,
        user_metadata: dict[str, Any] | None = None,
        status: str = "ready",
        overwrite: bool = False,
    ) -> CheckpointRecord:
        """Record a checkpoint (``tinker://{run_id}/{kind}/{name}``).

        If the name is taken: with ``overwrite`` the row is replaced as a whole (new time,
        path, size, metadata...), otherwise ``ConflictError`` is raised and nothing changes.
        """
        _check(kind, CHECKPOINT_KINDS, "checkpoint kind")
        _check(status, CHECKPOINT_STATUSES, "checkpoint status")
        if not name or "/" in name:
            raise ValueError(f"invalid checkpoint name {name!r}: must be non-empty, without '/'")
        values: dict[str, Any] = dict(
            run_id=run_id,
            kind=kind,
            name=name,
            owner=owner,
            storage_path=storage_path,
            size_bytes=size_bytes,
            created_at=self._clock(),
            expires_at=_aware(expires_at),
            public=public,
            user_metadata=dict(user_metadata or {}),
            status=status,
        )
        if overwrite:
            insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
            stmt = insert(CheckpointTable).values(**values)
            stmt = stmt.on_conflict_do_update(
                index_elements=["run_id", "kind", "name"],
                set_={k: stmt.excluded[k] for k in values if k not in ("run_id", "kind", "name")},
            )
            with self._tx() as s:
                s.execute(stmt)
        else:
            try:
                with self._tx() as s:
                    s.add(CheckpointTable(**values))
            except IntegrityError as exc:
                raise ConflictError(
                    f"checkpoint tinker://{run_id}/{kind}/{name} already exists"
                ) from exc
        return CheckpointRecord(**values)

    def get_checkpoint(self, run_id: str, kind: str, name: str) -> CheckpointRecord | None:
        return self._get(CheckpointRecord, CheckpointTable, (run_id, kind, name))

    def set_checkpoint_status(
        self, run_id: str, kind: str, name: str, status: str, *, size_bytes: int | None = None
    ) -> bool:
        """Move a checkpoint to ready / failed once its files are written (or not)."""
        _check(status, CHECKPOINT_STATUSES, "checkpoint status")
        values: dict[str, Any] = {"status": status}
        if size_bytes is not None:
            values["size_bytes"] = size_bytes
        return (
            self._update(
                update(CheckpointTable).where(*_ckpt_key(run_id, kind, name)).values(**values)
            )
            > 0
        )

    def list_checkpoints(
        self, run_id: str, *, include_unready: bool = False
    ) -> list[CheckpointRecord]:
        """One run's checkpoints of every kind, newest first (only ``ready`` by default)."""
        query = select(CheckpointTable).where(CheckpointTable.run_id == run_id)
        if not include_unready:
            query = query.where(CheckpointTable.status == "ready")
        return self._list(CheckpointRecord, query.order_by(*_CKPT_NEWEST_FIRST))

    def latest_checkpoint(self, run_id: str, kind: str) -> CheckpointRecord | None:
        """The newest ready checkpoint of one kind (TrainingRun.last_[sampler_]checkpoint)."""
        query = (
            select(CheckpointTable)
            .where(
                CheckpointTable.run_id == run_id,
                CheckpointTable.kind == kind,
                CheckpointTable.status == "ready",
            )
            .order_by(*_CKPT_NEWEST_FIRST)
            .limit(1)
        )
        found = self._list(CheckpointRecord, query)
        return found[0] if found else None

    def list_user_checkpoints(
        self, owner: str, limit: int = 100, offset: int = 0
    ) -> Page[CheckpointRecord]:
        """Every ready checkpoint of the owner, across runs, newest first."""
        query = select(CheckpointTable).where(
            CheckpointTable.owner == owner, CheckpointTable.status == "ready"
        )
        return self._page(CheckpointRecord, query, _CKPT_NEWEST_FIRST, limit, offset)

    def owner_storage_bytes(self, owner: str) -> int:
        """Total size of an owner's checkpoints (for the per-key quota)."""
        query = select(func.coalesce(func.sum(CheckpointTable.size_bytes), 0)).where(CheckpointTable.owner == owner)
        with self._tx() as s:
            return int(s.scalar(query) or 0)

    def storage_bytes_by_owner(self) -> dict[str, int]:
        """Total size of every owner's checkpoints (for metrics): one grouped query."""
        query = select(CheckpointTable.owner, func.sum(CheckpointTable.size_bytes)).group_by(CheckpointTable.owner)
        with self._tx() as s:
            return {owner: int(size or 0) for owner, size in s.execute(query)}

    def owner_storage_summary(self, owner: str, project_id: str | None = None) -> tuple[int, int]:
        """``(checkpoint count, bytes)`` of an owner's checkpoints, counted as the quota counts them.

        With ``project_id``: only checkpoints of runs whose session belongs to that project.
        """
        query = select(func.count(), func.coalesce(func.sum(CheckpointTable.size_bytes), 0)).where(
            CheckpointTable.owner == owner
        )
        if project_id is not None:
            runs = (
                select(ModelTable.model_id)
                .join(SessionTable, SessionTable.session_id == ModelTable.session_id)
                .where(SessionTable.project_id == project_id)
            )
            query = query.where(CheckpointTable.run_id.in_(runs))
        with self._tx() as s:
            count, size = s.execute(query).one()
        return int(count), int(size or 0)

    # ------------------------------------------------------------------ usage

    def add_usage(self, rows: Sequence[UsageRecord]) -> None:
        """Add token counts to their buckets (created on first use), all in one transaction."""
        if not rows:
            return
        insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        with self._tx() as s:
            for r in rows:
                _check(r.kind, USAGE_KINDS, "usage kind")
                stmt = insert(UsageTable).values(
                    owner=r.owner, bucket_start=_aware(r.bucket_start), kind=r.kind, base_model=r.base_model,
                    session_id=r.session_id, tokens=r.tokens,
                )
                stmt = stmt.on_conflict_do_update(
                    index_elements=["owner", "bucket_start", "kind", "base_model", "session_id"],
                    set_={"tokens": UsageTable.tokens + stmt.excluded.tokens},
                )
                s.execute(stmt)

    def usage_between(self, owner: str, start: datetime, end: datetime) -> list[UsageRecord]:
        """An owner's usage buckets with ``start <= bucket_start < end``, by bucket then most tokens."""
        query = (
            select(UsageTable)
            .where(UsageTable.owner == owner, UsageTable.bucket_start >= _aware(start),
                   UsageTable.bucket_start < _aware(end))
            .order_by(UsageTable.bucket_start, UsageTable.tokens.desc(), UsageTable.kind)
        )
        return self._list(UsageRecord, query)

    def delete_checkpoint(self, run_id: str, kind: str, name: str) -> bool:
        """Forget the row (the caller removes the files). False if it did not exist."""
        return self._update(delete(CheckpointTable).where(*_ckpt_key(run_id, kind, name))) > 0

    def set_public(self, run_id: str, kind: str, name: str, public: bool) -> bool:
        """Publish / unpublish. False if the checkpoint is missing or already in that state
        (the API answers 404 or 409 after looking the row up)."""
        stmt = (
            update(CheckpointTable)
            .where(*_ckpt_key(run_id, kind, name), CheckpointTable.public != public)
            .values(public=public)
        )
        return self._update(stmt) > 0

    def set_expires_at(
        self, run_id: str, kind: str, name: str, expires_at: datetime | None
    ) -> bool:
        """Set or clear (None) the expiry time. False if the checkpoint is missing."""
        stmt = (
            update(CheckpointTable)
            .where(*_ckpt_key(run_id, kind, name))
            .values(expires_at=_aware(expires_at))
        )
        return self._update(stmt) > 0

    def set_ttl(self, run_id: str, kind: str, name: str, ttl_seconds: int | None) -> bool:
        """``PUT .../ttl``: expire ``ttl_seconds`` from now, or never (None)."""
        expires_at = None if ttl_seconds is None else self._clock() + timedelta(seconds=ttl_seconds)
        return self.set_expires_at(run_id, kind, name, expires_at)

    def list_expired(self, now: datetime | None = None) -> list[CheckpointRecord]:
        """Checkpoints whose expiry time has passed (at or before ``now``), oldest expiry first."""
        now = _aware(now) or self._clock()
        query = (
            select(CheckpointTable)
            .where(CheckpointTable.expires_at.is_not(None), CheckpointTable.expires_at <= now)
            .order_by(CheckpointTable.expires_at, CheckpointTable.run_id, CheckpointTable.name)
        )
        return self._list(CheckpointRecord, query)

    # ------------------------------------------------------------------ run metrics (dashboard)
    def list_run_metrics(self, model_id: str) -> list[RunMetricRecord]:
        """A run's metric history, oldest first (bounded by ``thin_run_metrics``)."""
        query = select(RunMetricTable).where(RunMetricTable.model_id == model_id).order_by(RunMetricTable.id)
        return self._list(RunMetricRecord, query)

    def optimizer_steps(self, model_ids: Sequence[str]) -> dict[str, int]:
        """Optimizer steps each run has recorded (its last optim_step's step + 1); runs with none are absent."""
        if not model_ids:
            return {}
        query = (
            select(RunMetricTable.model_id, func.max(RunMetricTable.step))
            .where(RunMetricTable.model_id.in_(list(model_ids)), RunMetricTable.kind == "optim_step")
            .group_by(RunMetricTable.model_id)
        )
        with self._tx() as s:
            return {m: int(step) + 1 for m, step in s.execute(query).all()}

    def thin_run_metrics(self, max_points: int) -> int:
        """Keep every run's history within ``max_points``: a run over it loses every other point
        of its older half, so recent steps stay whole and old ones grow sparser. Returns the
        points deleted."""
        if max_points < 2:
            raise ValueError("max_points must be >= 2")
        over = (
            select(RunMetricTable.model_id)
            .group_by(RunMetricTable.model_id)
            .having(func.count() > max_points)
        )
        deleted = 0
        with self._tx() as s:
            for model_id in s.scalars(over).all():
                ids = s.scalars(
                    select(RunMetricTable.id).where(RunMetricTable.model_id == model_id).order_by(RunMetricTable.id)
                ).all()
                older = ids[: len(ids) - max_points // 2]
                doomed = older[1::2]
                for i in range(0, len(doomed), 500):
                    s.execute(delete(RunMetricTable).where(RunMetricTable.id.in_(doomed[i:i + 500])))
                deleted += len(doomed)
        return deleted

    def list_recent_models(self, owner: str | None, limit: int = 200) -> list[ModelRecord]:
        """Training runs, most recently active first: one owner's, or everyone's (``owner=None``)."""
        query = select(ModelTable)
        if owner is not None:
            query = query.where(ModelTable.owner == owner)
        query = query.order_by(ModelTable.last_request_at.desc(), ModelTable.model_id).limit(limit)
        return self._list(ModelRecord, query)

    # ------------------------------------------------------------------ server lease

    def get_lease(self, name: str = SERVER_LEASE) -> LeaseRecord | None:
        """Who holds the database, if anyone."""
        return self._get(LeaseRecord, ServerLeaseTable, name)

    def take_lease(
        self,
        holder: str,
        *,
        host: str,
        pid: int,
        data_dir: str,
        pid_namespace: str | None = None,
        replacing: str | None = None,
        name: str = SERVER_LEASE,
    ) -> bool:
        """Become the holder; True if this call did.

        With ``replacing=None`` the lease must be free (no row); otherwise it is taken from
        holder ``replacing`` only if that one still holds it. Of two servers racing for the
        same lease, exactly one gets True. Whether the current holder is gone is the caller's
        judgement; this only makes the hand-over atomic.
        """
        now = self._clock()
        values = dict(holder=holder, host=host, pid=pid, pid_namespace=pid_namespace, data_dir=data_dir,
                      acquired_at=now, heartbeat_at=now)
        if replacing is not None:
            stmt = (
                update(ServerLeaseTable)
                .where(ServerLeaseTable.name == name, ServerLeaseTable.holder == replacing)
                .values(**values)
            )
            return self._update(stmt) > 0
        try:
            with self._tx() as s:
                s.add(ServerLeaseTable(name=name, **values))
            return True
        except IntegrityError:
            return False

    def renew_lease(self, holder: str, name: str = SERVER_LEASE) -> bool:
        """Record a sign of life. False when ``holder`` no longer holds the lease."""
        stmt = (
            update(ServerLeaseTable)
            .where(ServerLeaseTable.name == name, ServerLeaseTable.holder == holder)
            .values(heartbeat_at=self._clock())
        )
        return self._update(stmt) > 0

    def release_lease(self, holder: str, name: str = SERVER_LEASE) -> bool:
        """Give the lease back (clean shutdown). False when ``holder`` did not hold it."""
        stmt = delete(ServerLeaseTable).where(
            ServerLeaseTable.name == name, ServerLeaseTable.holder == holder
        )
        return self._update(stmt) > 0


_CKPT_NEWEST_FIRST = (
    CheckpointTable.created_at.desc(),
    CheckpointTable.run_id,
    CheckpointTable.kind,
    CheckpointTable.name,
)


def _ckpt_key(run_id: str, kind: str, name: str) -> tuple[ColumnElement[bool], ...]:
    return (
        CheckpointTable.run_id == run_id,
        CheckpointTable.kind == kind,
        CheckpointTable.name == name,
    )
