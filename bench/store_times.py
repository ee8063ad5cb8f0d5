"""When requests reached a server's store, when their work began and when they completed, read from
its SQLite file (the embedded default store): what the server itself took, apart from the HTTP
path and the client's threads (which share the machine in these benchmarks)."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from pathlib import Path


def request_spans(database: Path, kind: str, owner: str | None = None) -> list[tuple[float, float | None, float]]:
    """(created, started, completed) epoch seconds of the completed requests of ``kind`` (and
    ``owner``, as ``tinsmith.api.auth.owner_for_key`` names a key's tenant), in order of creation:
    ``started`` is when the request left the server's queue and its work began (None for a request
    stored before the server recorded it)."""

    def epoch(text: str | None) -> float | None:
        return None if text is None else datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()

    query = "select created_at, started_at, completed_at from requests where kind = ? and completed_at is not null"
    args: tuple = (kind,)
    if owner is not None:
        query, args = query + " and owner = ?", (kind, owner)
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as con:
        return sorted((epoch(c), epoch(s), epoch(d)) for c, s, d in con.execute(query, args))


def request_times(database: Path, kind: str, owner: str | None = None) -> list[tuple[float, float]]:
    """(created, completed) epoch seconds of those requests (:func:`request_spans` without the start)."""
    return [(c, d) for c, _, d in request_spans(database, kind, owner)]
