"""Sessions: create, heartbeat, finish, list, trace export."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api import signed_links

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, owned_session, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.api.schemas import CreateSessionRequest, FinishSessionRequest, Int64Query, SessionHeartbeatRequest
from tinsmith.api.trace import session_trace_json

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    s = await run_in_threadpool(
        lambda: state_of(request).store.create_session(
            caller.owner, tags=body.tags, user_metadata=body.user_metadata, sdk_version=body.sdk_version,
            project_id=body.project_id, display_name=body.display_name,
        )
    )
    return {"session_id": s.session_id}


@router.post("/session_heartbeat")
async def heartbeat(body: SessionHeartbeatRequest, request: Request, caller: Caller = Depends(caller_of)):
    state = state_of(request)
    await owned_session(state, caller, body.session_id)
    if not await run_in_threadpool(state.store.heartbeat, body.session_id):
        # 410 tells the SDK to stop its heartbeat loop for good.
        return JSONResponse({"detail": f"session {body.session_id!r} is finished"}, status_code=410)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    await owned_session(state, caller, session_id)
    raw = await request.body()
    body = FinishSessionRequest.model_validate(await request.json()) if raw else FinishSessionRequest()
    if await run_in_threadpool(state.store.finish_session, session_id, body.reason.type, body.detail):
        await state.release_session_runs(session_id)
    return {}


@router.get("/sessions")
async def list_sessions(request: Request, limit: Int64Query = 20, offset: Int64Query = 0, caller: Caller = Depends(caller_of)) -> dict:
    page = await run_in_threadpool(state_of(request).store.list_sessions, caller.owner, max(1, min(limit, 1000)), max(0, offset))
    return {"sessions": [s.session_id for s in page.items]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    s = await owned_session(state, caller, session_id)
    models = await run_in_threadpool(state.store.list_session_models, session_id)
    samplers = await run_in_threadpool(state.store.list_session_sampling_sessions, session_id)
    return {
        "training_run_ids": [m.model_id for m in models],
        "sampler_ids": [x.sampling_session_id for x in samplers],
        "user_metadata": {k: str(v) for k, v in (s.user_metadata or {}).items()},
        "display_name": s.display_name,
    }


TRACE_LINK = "session-trace"  # the kind of signed link (so a link to another kind of file never opens a trace)


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    """A signed link to the session's request trace (``tinker session export-trace``).

    The trace is built when the link is opened, so it is always ready at once and always current.
    """
    state = state_of(request)
    await owned_session(state, caller, session_id)
    expires = signed_links.new_expiry()
    sig = signed_links.sign(state.secret, TRACE_LINK, session_id, expires)
    base = (state.config.public_url or str(request.base_url)).rstrip("/")
    return {"status": "ready", "url": f"{base}/api/v1/trace_downloads/{quote(session_id, safe='')}/{expires}/{sig}"}


@router.get("/trace_downloads/{session_id}/{expires}/{sig}")
async def trace_download(session_id: str, expires: int, sig: str, request: Request) -> Response:
    """Signed, expiring, unauthenticated trace download (what trace_export hands out)."""
    state = state_of(request)
    if not signed_links.valid(state.secret, sig, expires, TRACE_LINK, session_id):
        return JSONResponse({"detail": "download link is invalid or expired"}, status_code=403)
    session = await run_in_threadpool(state.store.get_session, session_id)
    if session is None:
        return JSONResponse({"detail": f"session {session_id!r} not found"}, status_code=404)
    entries = await run_in_threadpool(state.store.session_trace, session_id)
    body = session_trace_json(session, entries, datetime.now(UTC))
    return Response(body, media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{quote(session_id, safe="")}.pftrace"'})
