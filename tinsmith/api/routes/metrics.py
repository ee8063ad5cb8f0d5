"""``GET /metrics``: the Prometheus text exposition of this server (see docs/operating.md).

Open on the server's address by default, like most exporters; ``--metrics-auth`` requires an
accepted API key, as ``X-API-Key`` (the SDK's header) or ``Authorization: Bearer`` (what
Prometheus' ``authorization`` scrape option sends).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from tinsmith.api.common import state_of
from tinsmith.server.metrics import CONTENT_TYPE

router = APIRouter()


def _presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    state = state_of(request)
    if state.config.metrics_auth:
        state.auth.authenticate(_presented_key(request))
    # Off the event loop: a scrape reads the database (sessions, checkpoint bytes).
    return Response(await run_in_threadpool(state.metrics.render), media_type=CONTENT_TYPE)
