"""UsageMeter: token counts gather in memory by key, hour, kind, model and session, and reach the
store in one batch per flush; a failed flush keeps them for the next."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tinsmith.server.usage import UsageMeter, hour_of, session_of
from tinsmith.store.records import UsageRecord


class RecordingStore:
    def __init__(self) -> None:
        self.batches: list[list[UsageRecord]] = []
        self.fail = False

    def add_usage(self, rows):
        if self.fail:
            raise RuntimeError("database down")
        self.batches.append(list(rows))


def test_counts_are_batched_per_bucket():
    store = RecordingStore()
    meter = UsageMeter(store)
    at = datetime(2026, 1, 1, 10, 42, 7, tzinfo=UTC)
    for _ in range(100):
        meter.record("alice", "sampling_sample", 3, base_model="m", session_id="s", at=at)
    meter.record("alice", "training", 50, base_model="m", session_id="s", at=at)
    meter.record("bob", "training", 0, at=at)  # nothing used, nothing recorded
    assert meter.pending() == 2
    assert meter.flush() == 2 and meter.pending() == 0
    (batch,) = store.batches
    hour = datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert sorted(batch, key=lambda r: r.kind) == [UsageRecord("alice", hour, "sampling_sample", "m", "s", 300),
                                                   UsageRecord("alice", hour, "training", "m", "s", 50)]
    assert meter.flush() == 0 and len(store.batches) == 1  # nothing new: no write


def test_a_failed_flush_keeps_the_counts():
    store = RecordingStore()
    meter = UsageMeter(store)
    at = datetime(2026, 1, 1, 10, tzinfo=UTC)
    meter.record("alice", "training", 5, at=at)
    store.fail = True
    with pytest.raises(RuntimeError):
        meter.flush()
    meter.record("alice", "training", 2, at=at)
    store.fail = False
    meter.flush()
    assert store.batches == [[UsageRecord("alice", at, "training", "", "", 7)]]


def test_hours_and_sessions():
    assert hour_of(datetime(2026, 3, 1, 23, 59, 59, 999, tzinfo=UTC)) == datetime(2026, 3, 1, 23, tzinfo=UTC)
    assert session_of("abc-1:train:3") == "abc-1" and session_of("abc-1:sample:0") == "abc-1"
    assert session_of(None) == "" and session_of("direct") == ""
