"""The web dashboard (``/dashboard``) and the JSON it reads (``/dashboard/api/...``).

The page is a small static bundle (HTML, one JS file, one CSS file, all in
``tinsmith/api/dashboard/``): no build step, nothing fetched from elsewhere. The browser keeps
the API key in ``sessionStorage`` and sends it as ``X-API-Key``, so every JSON endpoint here
authenticates exactly as the API does, and deleting a checkpoint uses the API's own route.

What a caller sees: its own runs, checkpoints, sampler snapshots and queued requests. A key
marked ``admin`` in the keys file reads every key's, with their owners; it gains no write access
(downloads and deletes stay with the owner, as in the API). ``tinsmith status`` prints the
summary endpoint's answer for a terminal.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.api.routes.checkpoints import checkpoint_json, owned_checkpoint_files
from tinsmith.errors import NotFoundError
from tinsmith.server.health import read_health
from tinsmith.server.state import ServerState
from tinsmith.store.records import CheckpointRecord, ModelRecord, RunMetricRecord

router = APIRouter(route_class=ApiRoute)

ASSETS = Path(__file__).resolve().parent.parent / "dashboard"
RUNS_SHOWN = 200  # the most recently active runs listed in the summary
CHART_POINTS = 600  # a series longer than this is thinned evenly for the chart (the last point kept)

# Nothing but this server's own files: no inline script, no inline style, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
ASSET_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(timezone.utc).isoformat()


def _tinsmith_version() -> str:
    try:
        return version("tinsmith")
    except PackageNotFoundError:
        return "unknown"


def _sees(caller: Caller, owner: str) -> bool:
    return caller.admin or owner == caller.owner


def _run_json(m: ModelRecord, steps: dict[str, int]) -> dict:
    return {"model_id": m.model_id, "owner": m.owner, "base_model": m.base_model, "is_lora": m.is_lora,
            "lora_rank": m.lora_rank, "status": m.status, "steps": steps.get(m.model_id, 0),
            "created_at": _iso(m.created_at), "last_activity": _iso(m.last_request_at),
            "session_id": m.session_id, "user_metadata": {k: str(v) for k, v in (m.user_metadata or {}).items()}}


def _checkpoint_json(ck: CheckpointRecord, caller: Caller) -> dict:
    mine = ck.owner == caller.owner
    return {**checkpoint_json(ck), "run_id": ck.run_id, "kind": ck.kind, "name": ck.name, "owner": ck.owner,
            "status": ck.status, "downloadable": mine and ck.status == "ready", "deletable": mine}


def metric_series(points: list[RunMetricRecord], max_points: int = CHART_POINTS) -> dict[str, list[list[float]]]:
    """``{metric name: [[step, value], ...]}`` in recording order, each at most ``max_points`` long."""
    series: dict[str, list[list[float]]] = {}
    for p in points:
        for name, value in p.metrics.items():
            if value is not None:
                series.setdefault(name, []).append([p.step, value])
    for name, values in series.items():
        if len(values) > max_points:
            stride = len(values) / max_points
            thinned = [values[int(i * stride)] for i in range(max_points - 1)]
            series[name] = thinned + [values[-1]]
    return series


def _samplers(state: ServerState, caller: Caller) -> list[dict]:
    """Sampler snapshots held in memory (the dict is copied first: the worker thread may change it)."""
    out = []
    for snap in list(state.worker.snapshots.values()):
        if _sees(caller, snap.owner):
            out.append({"key": snap.key, "owner": snap.owner, "base_model": snap.base.name,
                        "lora_rank": snap.spec.rank, "stored": snap.reloadable,
                        "idle_s": round(time.monotonic() - snap.last_used, 1)})
    return out


async def summary(state: ServerState, caller: Caller) -> dict:
    """The whole picture for one caller: what the dashboard's overview and ``tinsmith status`` show."""
    owner = None if caller.admin else caller.owner
    runs = await run_in_threadpool(state.store.list_recent_models, owner, RUNS_SHOWN)
    steps = await run_in_threadpool(state.store.optimizer_steps, [m.model_id for m in runs])
    health = await run_in_threadpool(read_health)
    return {
        "caller": {"owner": caller.owner, "admin": caller.admin, "single_user": not state.auth.multi_tenant},
        "server": {"version": _tinsmith_version(), "base_models": sorted([*state.worker.bases, *state.worker.aliases]),
                   "uptime_s": round(time.time() - state.started_at, 1)},
        "runs": [_run_json(m, steps) for m in runs],
        "queue": [e for e in state.engine.queue_view() if _sees(caller, e["owner"])],
        "samplers": _samplers(state, caller),
        "health": health.as_dict(),
        "throughput": state.throughput.as_dict(),
    }


async def _visible_run(state: ServerState, caller: Caller, model_id: str) -> ModelRecord:
    m = await run_in_threadpool(state.store.get_model, model_id)
    if m is None or not _sees(caller, m.owner):
        raise NotFoundError(f"training run {model_id!r} not found")
    return m


# --------------------------------------------------------------------------------- JSON
@router.get("/dashboard/api/summary")
async def summary_json(request: Request, caller: Caller = Depends(caller_of)) -> dict:
    return await summary(state_of(request), caller)


@router.get("/dashboard/api/runs/{model_id}")
async def run_detail(model_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    m = await _visible_run(state, caller, model_id)
    points = await run_in_threadpool(state.store.list_run_metrics, m.model_id)
    steps = await run_in_threadpool(state.store.optimizer_steps, [m.model_id])
    checkpoints = await run_in_threadpool(state.store.list_checkpoints, m.model_id)
    return {"run": _run_json(m, steps), "points": len(points), "metrics": metric_series(points),
            "checkpoints": [_checkpoint_json(c, caller) for c in checkpoints if _sees(caller, c.owner)]}


@router.get("/dashboard/api/runs/{model_id}/checkpoints/{kind}/{name}/files")
async def checkpoint_files(model_id: str, kind: str, name: str, request: Request,
                           caller: Caller = Depends(caller_of)) -> dict:
    """Signed download links for a checkpoint's files: its owner only, as the API's own routes."""
    return await owned_checkpoint_files(state_of(request), request, caller, model_id, kind, name)


# --------------------------------------------------------------------------------- page and assets
@router.get("/dashboard", include_in_schema=False)
@router.get("/dashboard/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(ASSETS / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/dashboard/{asset}", include_in_schema=False)
async def asset(asset: str) -> FileResponse:
    if asset not in ASSET_TYPES:
        raise NotFoundError(f"{asset!r} not found")
    return FileResponse(ASSETS / asset, media_type=ASSET_TYPES[asset], headers=PAGE_HEADERS)
