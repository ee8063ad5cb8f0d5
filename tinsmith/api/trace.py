"""A session's request trace as a Chrome/Perfetto JSON trace (``tinker session export-trace``).

One track per training run and per sampler; each request is a "queued" slice (received until
started) followed by a slice named after its kind (started until finished), with its id,
status, sequence number and payload and result sizes as arguments. No payloads, no results.
Perfetto (ui.perfetto.dev) and chrome://tracing open the file as it is.
"""

from __future__ import annotations

import json
from datetime import datetime

from tinsmith.store.records import SessionRecord, TraceEntry


def _us(at: datetime, origin: datetime) -> float:
    return (at - origin).total_seconds() * 1e6


def session_trace_json(session: SessionRecord, entries: list[TraceEntry], now: datetime) -> bytes:
    """The trace of ``entries`` (a session's requests, oldest first); unfinished ones end at ``now``."""
    origin = session.created_at
    tracks: dict[str, int] = {}
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"session {session.session_id}"}}]
    for e in entries:
        track = e.model_id or e.sampling_session_id or "requests"
        if track not in tracks:
            tracks[track] = len(tracks) + 1
            events.append({"ph": "M", "pid": 1, "tid": tracks[track], "name": "thread_name", "args": {"name": track}})
        tid = tracks[track]
        args = {"request_id": e.request_id, "status": e.status, "seq_id": e.seq_id, "payload_bytes": e.payload_bytes,
                "result_bytes": e.result_bytes, "error_category": e.error_category}
        started = e.started_at or e.completed_at or now
        events.append({"ph": "X", "pid": 1, "tid": tid, "cat": "queue", "name": "queued", "ts": _us(e.created_at, origin),
                       "dur": max(0.0, _us(started, origin) - _us(e.created_at, origin)), "args": args})
        if e.started_at is not None or e.completed_at is not None:
            end = e.completed_at or now
            events.append({"ph": "X", "pid": 1, "tid": tid, "cat": "request", "name": e.kind, "ts": _us(started, origin),
                           "dur": max(0.0, _us(end, origin) - _us(started, origin)), "args": args})
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "metadata": {"session_id": session.session_id, "created_at": origin.isoformat(),
                          "requests": len(entries)}}
    return json.dumps(trace).encode()
