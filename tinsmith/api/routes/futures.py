"""``retrieve_future``: a long-poll that wakes the moment the engine stores the result."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.api.schemas import RetrieveFutureRequest
from tinsmith.errors import ExpiredError, NotFoundError

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)


def _answer(result: bytes | None, content_type: str | None, error: str | None, category: str | None) -> Response:
    if error is not None:
        return JSONResponse({"error": error, "category": category or "server"})
    return Response(content=result or b"{}", media_type=content_type or "application/json")


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, request: Request, caller: Caller = Depends(caller_of)) -> Response:
    state = state_of(request)
    rid = body.request_id
    engine = state.engine
    if engine.pending(rid):
        # Owner check without a database round trip: the engine knows who submitted it.
        owner = engine.owner_of(rid)
        if owner is not None and owner != caller.owner:
            raise NotFoundError(f"request {rid!r} not found")
        out = await engine.wait(rid, state.config.long_poll_seconds)
        if out is not None:
            return _answer(out.result, out.content_type, out.error, out.category)
    rec = await run_in_threadpool(state.store.get_request, rid)
    if rec is None or rec.owner != caller.owner:
        raise NotFoundError(f"request {rid!r} not found")
    if rec.status == "completed" and rec.is_purged:
        raise ExpiredError(
            f"the result of request {rid!r} expired: results are kept for "
            f"{state.config.request_retention_s:.0f} s after the request finishes (--request-retention-s)"
        )
    if rec.status == "completed":
        return _answer(rec.result, rec.result_content_type, None, None)
    if rec.status == "failed":
        return _answer(None, None, rec.error, rec.error_category)
    return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active",
                         "queue_state_reason": f"{engine.queue_depth()} request(s) queued"})
