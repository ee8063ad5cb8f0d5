"""One log line and one metrics sample per HTTP request.

:class:`RequestObserver` wraps the whole application (outside the body limit, so a 413 is seen
too). It times the request, reads its status from the response start, takes the route's
*template* (``/api/v1/training_runs/{model_id}``, never the raw path, so metric labels stay
few) from the scope the router filled in, and writes one line:

    request POST /api/v1/forward_backward 200 3.1 ms key=1f2e3d4c run=3b9... tokens=512

Handlers add what only they know (the run, the request's tokens, the reason for a refusal) with
:func:`note_request`, through a context variable: no lock, no database, no work per request
beyond a few attribute writes. The API key itself is never logged, only its key id (a short
hash), and neither are bodies. A refused request (429) is logged at warning with the reason,
so shed work shows up in a warning-level log without a second line; refusals of a key's request
rate, which can come by the thousand, are reported once per key and while instead
(:mod:`tinsmith.api.request_rates`) and their lines go to debug.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from tinsmith.server.metrics import ServerMetrics
from tinsmith.tenants import key_id_for_api_key

log = logging.getLogger("tinsmith.requests")

UNMATCHED_ROUTE = "unmatched"  # the label of a path no route serves (404s of scanners): one series
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # any other: "other"


@dataclass
class RequestNote:
    """What a handler learnt about its request, for the request's log line."""

    run: str | None = None
    tokens: int | None = None
    reason: str | None = None
    quiet: bool = False  # a refusal reported elsewhere in sum (a key's rate): its line at debug, not warning


_note: ContextVar[RequestNote | None] = ContextVar("tinsmith_request_note", default=None)


def note_request(*, run: str | None = None, tokens: int | None = None, reason: str | None = None,
                 quiet: bool = False) -> None:
    """Add to the current request's log line (a no-op outside a request); ``quiet``: log the line
    at debug level, for refusals that are reported in sum instead (one warning per key and while)."""
    note = _note.get()
    if note is None:
        return
    if run is not None:
        note.run = run
    if tokens is not None:
        note.tokens = tokens
    if reason is not None:
        note.reason = reason
    note.quiet = note.quiet or quiet


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


def route_template(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED_ROUTE


class RequestObserver:
    """ASGI middleware: times, counts and logs every HTTP request."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # what the client gets if the application fails before answering
        note = RequestNote()
        token = _note.set(note)

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            _note.reset(token)
            self._record(scope, status, time.perf_counter() - start, note)

    def _record(self, scope, status: int, seconds: float, note: RequestNote) -> None:
        route = route_template(scope)
        method = scope.get("method", "") if scope.get("method") in METHODS else "other"
        self.metrics.observe_request(route, method, status, seconds)
        key = _header(scope, b"x-api-key")
        params = scope.get("path_params") or {}
        run = note.run or params.get("model_id") or params.get("run_id")
        fields = {"route": route, "method": method, "status": status, "duration_ms": round(1000 * seconds, 1),
                  "key_id": key_id_for_api_key(key) if key else None, "run": run, "tokens": note.tokens}
        if status >= 400 and note.reason:
            fields["reason"] = note.reason
        level = logging.WARNING if status == 429 or status >= 500 else logging.INFO
        if note.quiet and status < 500:
            level = logging.DEBUG
        if not log.isEnabledFor(level):
            return
        text = f"{method} {route} {status} {fields['duration_ms']:.1f} ms key={fields['key_id'] or '-'}"
        if run:
            text += f" run={run}"
        if note.tokens is not None:
            text += f" tokens={note.tokens}"
        if "reason" in fields:
            text += f" reason={note.reason!r}"
        log.log(level, "request %s", text, extra={"fields": fields})
