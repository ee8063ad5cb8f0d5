"""Futures: ``retrieve_future`` (one request), ``retrieve_futures`` (a sampler's completions) and
``cancel_future``. Long-polls wake the moment the engine stores a result."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.api.schemas import CancelFutureRequest, RetrieveFutureRequest, RetrieveFuturesRequest
from tinsmith.errors import ExpiredError, InvalidInputError, NotFoundError
from tinsmith.store import Store

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
    rec = await run_in_threadpool(state.store.get_result, rid)
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


@router.post("/retrieve_futures")
async def retrieve_futures(body: RetrieveFuturesRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    """The requests of one sampling client that finished after ``prev_cursor``, in the order they
    finished, and the cursor to pass next.

    Cursors are numbers of the sampler's durable completion order, so they stay valid across a
    restart. With nothing new the call waits (``timeout``, at most ``--long-poll-seconds``) and
    answers as soon as one of the sampler's requests finishes. ``retrieved_request_ids``: results
    the client has fetched; their payloads are dropped at once rather than at the retention sweep.
    """
    state = state_of(request)
    sid, clone = body.target.sampling_session_id, body.target.cloned_sampler_id
    s = state.store.cached_sampling_session(sid) or await run_in_threadpool(state.store.get_sampling_session, sid)
    if s is None or s.owner != caller.owner:
        raise NotFoundError(f"target.sampling_session_id {sid!r} not found")
    wait_s = state.config.long_poll_seconds if body.timeout is None else min(body.timeout, state.config.long_poll_seconds)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    acks = list(body.retrieved_request_ids or [])  # dropped on the first read: the SDK sends one such poll per sample
    while True:
        finished = state.engine.listen(sid)  # before reading, so a completion in between still wakes us
        try:
            found, cursor = await run_in_threadpool(_ack_and_read, state.store, caller.owner, sid, clone,
                                                    body.prev_cursor, acks)
            acks = []
            left = deadline - loop.time()
            if found or left <= 0:
                break
            try:
                await asyncio.wait_for(finished.wait(), left)
            except asyncio.TimeoutError:
                pass
        finally:
            state.engine.unlisten(sid, finished)
    completions = [
        {"state": "finished", "request_id": c.request_id, "response_payload_uncompressed_size": c.result_size}
        if c.status == "completed" else {"state": "failed", "request_id": c.request_id}
        for c in found
    ]
    return {"completions": completions, "cursor": cursor}


def _ack_and_read(store: Store, owner: str, sid: str, clone: int, cursor: int, acks: list[str]):
    """One trip to a worker thread for a poll: drop the payloads of the results the client has
    fetched (``acks``), then read what finished after ``cursor``."""
    if acks:
        store.purge_retrieved(owner, sid, acks)
    return store.sampling_completions(sid, clone, cursor)


@router.post("/cancel_future")
async def cancel_future(body: CancelFutureRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    """Stop a sampling request whose client gave up on it.

    A queued request never runs; a running one leaves the batch before the sampler's next decode
    step and frees its cache rows. The future then fails with a cancellation error (category
    ``user``). Cancelling a finished request changes nothing (the answer says so); only sampling
    requests can be cancelled.
    """
    state = state_of(request)
    rid = body.request_id
    rec = await run_in_threadpool(state.store.get_request, rid)
    if rec is None or rec.owner != caller.owner:
        raise NotFoundError(f"request_id {rid!r} not found")
    if rec.kind != "sample":
        raise InvalidInputError(f"request_id {rid!r} is a {rec.kind} request; only sampling requests can be cancelled")
    if rec.is_finished:
        return {"request_id": rid, "cancelled": False, "status": rec.status}
    cancelled = state.engine.cancel(rid, known_sample=True)
    return {"request_id": rid, "cancelled": cancelled, "status": rec.status}
