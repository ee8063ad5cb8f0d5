"""Per-key token accounting: what each API key's completed work consumed, by UTC hour.

Counted where work completes (``WorkerOperations``): ``training`` (the input tokens of
forward and forward_backward datums), ``sampling_prefill`` / ``sampling_prefill_cached``
(prompt tokens computed, or served from the prefix cache) and ``sampling_sample`` (generated
tokens). Counts gather in memory and reach the ``usage`` table in batches (one transaction per
flush, one row per key, hour, kind, base model and session), every ``--usage-flush-s`` seconds,
before every usage answer, and when the server stops; so the numbers survive a restart without
a database write on the hot path. A crash loses at most the last interval's counts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from datetime import UTC, datetime

from tinsmith.store.records import UsageRecord

log = logging.getLogger(__name__)

_Key = tuple[str, datetime, str, str, str]  # owner, hour, kind, base model, session


def hour_of(at: datetime) -> datetime:
    """The start of the UTC hour ``at`` falls in."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def session_of(run_or_sampler_id: str | None) -> str:
    """The session a training run (``{session}:train:N``) or sampler (``{session}:sample:N``) was
    created in; ``""`` for ids of another form (samplers of a bare ``asample``)."""
    if not run_or_sampler_id:
        return ""
    for marker in (":train:", ":sample:"):
        head, sep, _ = run_or_sampler_id.rpartition(marker)
        if sep:
            return head
    return ""


class UsageMeter:
    """Thread-safe token counters, flushed to the store in batches."""

    def __init__(self, store) -> None:
        self.store = store
        self._counts: Counter[_Key] = Counter()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time, so counts land in order

    def record(self, owner: str, kind: str, tokens: int, *, base_model: str = "", session_id: str = "",
               at: datetime | None = None) -> None:
        if tokens <= 0:
            return
        key = (owner, hour_of(at or datetime.now(UTC)), kind, base_model, session_id)
        with self._lock:
            self._counts[key] += int(tokens)

    def pending(self) -> int:
        """Buckets counted but not yet written."""
        with self._lock:
            return len(self._counts)

    def flush(self) -> int:
        """Write every pending count in one transaction; returns the buckets written.

        On a database error the counts go back into the meter for the next flush, so none is lost.
        """
        with self._flush_lock:
            with self._lock:
                counts, self._counts = self._counts, Counter()
            if not counts:
                return 0
            try:
                self.store.add_usage([UsageRecord(*key, tokens=n) for key, n in counts.items()])
            except Exception:
                with self._lock:
                    self._counts.update(counts)
                raise
            return len(counts)
