"""Usage of the calling API key: tokens by hour (``AdminClient.get_billing_usage``) and current
checkpoint storage (``get_current_checkpoint_storage_usage``).

Token counts come from the server's own accounting (``tinsmith.server.usage``), storage from the
same checkpoint sizes the per-key quota counts. tinsmith has no prices: cost and rate fields
are null. Every key sees its own usage only.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.errors import InvalidInputError

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)

MAX_WINDOW = timedelta(days=14)
BYTES_PER_GIGABYTE = 1_000_000_000

# Usage kinds (the usage table's) -> the SDK's billing event payload.
_EVENT_INFO = {
    "training": lambda n: {"type": "training", "token_count": n},
    "sampling_prefill": lambda n: {"type": "sampling_prefill", "cached": False, "token_count": n},
    "sampling_prefill_cached": lambda n: {"type": "sampling_prefill", "cached": True, "token_count": n},
    "sampling_sample": lambda n: {"type": "sampling_sample", "token_count": n},
}


def _hour(value: datetime, field: str) -> datetime:
    """A window bound as an aware UTC datetime on an hour boundary (naive input counts as UTC)."""
    value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if value.minute or value.second or value.microsecond:
        raise InvalidInputError(f"{field} {value.isoformat()} must be aligned to a UTC hour boundary")
    return value


@router.get("/billing/usage/events")
async def billing_usage_events(request: Request, starting_on: datetime = Query(), ending_before: datetime = Query(),
                               caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    start, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
    if start > datetime.now(UTC):
        raise InvalidInputError(f"starting_on {start.isoformat()} is in the future")
    if end <= start:
        raise InvalidInputError("ending_before must be after starting_on")
    if end - start > MAX_WINDOW:
        raise InvalidInputError(f"ending_before is more than {MAX_WINDOW.days} days after starting_on")
    await state.flush_usage()  # counts gathered since the last periodic flush
    rows = await run_in_threadpool(state.store.usage_between, caller.owner, start, end)
    sessions = {}
    for sid in sorted({r.session_id for r in rows if r.session_id}):
        s = await run_in_threadpool(state.store.get_session, sid)
        if s is not None and s.owner == caller.owner:
            sessions[sid] = s
    data = [{
        "bucket_start": r.bucket_start.isoformat(),
        "bucket_end": (r.bucket_start + timedelta(hours=1)).isoformat(),
        "base_model": r.base_model or None,
        "session_id": r.session_id or None,
        "project_id": sessions[r.session_id].project_id if r.session_id in sessions else None,
        "event_info": _EVENT_INFO[r.kind](r.tokens),
    } for r in rows]
    return {
        "data": data,
        "sessions": {sid: {"user_metadata": {k: str(v) for k, v in (s.user_metadata or {}).items()} or None}
                     for sid, s in sessions.items()},
        "cost_data_through": None,
    }


@router.get("/billing/usage/checkpoints/current")
async def current_checkpoint_storage(request: Request, project_id: str | None = Query(None, min_length=1),
                                     caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    count, size = await run_in_threadpool(state.store.owner_storage_summary, caller.owner, project_id)
    return {
        "effective_rate_usd_per_gigabyte_month": None,
        "data": [{"project_id": project_id, "checkpoint_count": count, "size_bytes": size,
                  "size_gigabytes": size / BYTES_PER_GIGABYTE, "estimated_monthly_cost_usd": None}],
    }
