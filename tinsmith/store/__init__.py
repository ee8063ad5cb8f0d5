"""The durable record: sessions, training runs, requests (futures), samplers, checkpoints,
custom losses.

SQLAlchemy 2 tables and Alembic migrations; SQLite (WAL) is the embedded default and
PostgreSQL (``postgresql+psycopg://...``) the production option. Knows nothing of HTTP or
torch. Everything goes through ``Store``; it hands out frozen records, never ORM objects.
"""

from tinsmith.store.ids import model_id_for, new_request_id, new_session_id, sampling_session_id_for
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
from tinsmith.store.store import Store

__all__ = [
    "CheckpointRecord",
    "CustomLossRecord",
    "CompletionRecord",
    "LeaseRecord",
    "MetricPoint",
    "ModelRecord",
    "Page",
    "RequestOutcome",
    "RequestRecord",
    "ResultRecord",
    "RunMetricRecord",
    "SamplingSessionRecord",
    "SessionRecord",
    "Store",
    "TraceEntry",
    "UsageRecord",
    "model_id_for",
    "new_request_id",
    "new_session_id",
    "sampling_session_id_for",
]
