"""Checkpoints: save_state / load_state, external exports, and the RestClient resources
(training runs, checkpoint listings, delete, publish, TTL, weights info, download URLs)."""

from __future__ import annotations

import hmac
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import (caller_of, check_base_model_matches, owned_model, owned_session, readable_checkpoint,
                                 state_of, submit)
from tinsmith.api import signed_links
from tinsmith.api.request import ApiRoute
from tinsmith.api.schemas import Body, Int64Query, ModelSeqId
from tinsmith.checkpoints.age_encryption import parse_recipients
from tinsmith.checkpoints.paths import (KINDS, TinkerPath, check_name, checkpoint_directory, expiry_from_ttl,
                                       parse_tinker_path)
from tinsmith.checkpoints.state_format import lora_from_meta, optimizer_config_from_meta, read_meta
from tinsmith.errors import ConflictError, InvalidInputError, NotFoundError
from tinsmith.optim import normalize_optimizer_config, optimizer_type
from tinsmith.server.operations import LoadArgs, SaveArgs
from tinsmith.store.ids import model_id_for

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)

CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
URL_LIFETIME = timedelta(hours=1)


class SaveWeightsRequest(Body):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict | None = None
    age_encryption_recipients: list[str] | None = None  # save_weights_external only


class LoadWeightsRequest(Body):
    path: str
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: ModelSeqId | None = None
    base_model: str | None = None
    user_metadata: dict | None = None
    optimizer: bool = False
    optimizer_config: dict | None = None  # create-via-load without optimizer state: the new run's optimizer


class TtlRequest(Body):
    ttl_seconds: int | None = None


class WeightsInfoRequest(Body):
    tinker_path: str


class CopyWeightsRequest(Body):
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: ModelSeqId | None = None
    ttl_seconds: int | None = None


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(timezone.utc).isoformat()


def checkpoint_json(ck) -> dict:
    return {
        "checkpoint_id": f"{ck.kind}/{ck.name}",
        "checkpoint_type": CHECKPOINT_TYPE[ck.kind],
        "time": _iso(ck.created_at),
        "tinker_path": f"tinker://{ck.run_id}/{ck.kind}/{ck.name}",
        "size_bytes": ck.size_bytes,
        "public": ck.public,
        "user_metadata": {k: str(v) for k, v in (ck.user_metadata or {}).items()},
        "expires_at": _iso(ck.expires_at),
    }


async def _save(request: Request, caller: Caller, body: SaveWeightsRequest, kind: str, job_kind: str) -> dict:
    state = state_of(request)
    await owned_model(state, caller, body.model_id)
    recipients = body.age_encryption_recipients or []
    if recipients and kind != "external_weights":
        raise InvalidInputError("age_encryption_recipients applies to save_weights_external only")
    parse_recipients(recipients)  # refused here, with the entry named, rather than as a failed future
    tp = TinkerPath(body.model_id, kind, check_name(body.path))
    args = SaveArgs(kind, tp.name, str(tp), checkpoint_directory(state.config.resolved_checkpoint_dir, tp),
                    caller.owner, expiry_from_ttl(body.ttl_seconds), body.user_metadata, body.overwrite,
                    tuple(recipients))
    return await submit(state, caller, job_kind, args, payload=body.model_dump_json().encode(), payload_type="json",
                        model_id=body.model_id, seq_id=body.seq_id)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    return await _save(request, caller, body, "weights", "save_weights")


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    return await _save(request, caller, body, "external_weights", "save_weights_external")


def _same_base(state, a: str, b: str) -> bool:
    """Do two base-model names reach the same served model? (False when either is not served.)"""
    try:
        return state.worker.resolve_base(a) is state.worker.resolve_base(b)
    except InvalidInputError:
        return False


def _load_optimizer(body: LoadWeightsRequest, saved: dict, create: bool) -> dict:
    """The optimizer config of the run a load creates: the checkpoint's when its optimizer state is
    restored, else ``optimizer_config`` (default AdamW). Only a new run takes ``optimizer_config``."""
    if body.optimizer_config is None:
        return saved if body.optimizer else normalize_optimizer_config(None)
    if not create:
        raise InvalidInputError("optimizer_config applies only when load_weights creates a run "
                                "(session_id and model_seq_id); an existing run keeps its optimizer")
    wanted = normalize_optimizer_config(body.optimizer_config)
    if body.optimizer and wanted != saved:
        raise InvalidInputError(f"optimizer_config {wanted['type']!r} conflicts with the checkpoint's optimizer state "
                                f"({saved['type']!r}); omit it, or load the weights only")
    return wanted


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    tp = parse_tinker_path(body.path, "path")
    ck = await readable_checkpoint(state, caller, tp, "weights")
    meta = await run_in_threadpool(read_meta, Path(ck.storage_path))
    base_model = meta["base_model"]
    check_base_model_matches(state, body.base_model or None, base_model, body.path)
    create = body.model_id is None
    saved_optimizer = optimizer_config_from_meta(meta)
    optimizer = _load_optimizer(body, saved_optimizer, create)
    if create:
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidInputError("load_weights needs model_id, or session_id and model_seq_id")
        session = await owned_session(state, caller, body.session_id)
        if session.is_finished:
            raise InvalidInputError(f"session {body.session_id!r} is finished")
        model_id, seq_id = model_id_for(body.session_id, body.model_seq_id), 0
        lora = lora_from_meta(meta)
        # The checkpoint records the served model's internal name (for an alias, its target, e.g. a
        # local directory); the new run keeps the name the source run was created with.
        source = await run_in_threadpool(state.store.get_model, tp.run_id)
        run_base = base_model
        if source is not None and _same_base(state, source.base_model, base_model):
            run_base = source.base_model
        await run_in_threadpool(lambda: state.store.create_model(
            model_id, owner=caller.owner, base_model=body.base_model or run_base, session_id=body.session_id,
            model_seq_id=body.model_seq_id, is_lora=lora is not None, lora_rank=lora.rank if lora else None,
            lora_config=None if lora is None else dict(lora.__dict__), optimizer_config=optimizer,
            user_metadata=body.user_metadata))
    else:
        m = await owned_model(state, caller, body.model_id)
        model_id, seq_id = body.model_id, body.seq_id
        run_type = optimizer_type(m.optimizer_config)
        if body.optimizer and saved_optimizer["type"] != run_type:
            raise InvalidInputError(
                f"{body.path!r} holds {saved_optimizer['type']} optimizer state but model {model_id!r} uses {run_type}; "
                "load its weights only (load_state) or create a new run from it")
    args = LoadArgs(Path(ck.storage_path), base_model, body.optimizer, create, optimizer["type"])
    return await submit(state, caller, "load_weights", args, payload=body.model_dump_json().encode(),
                        payload_type="json", model_id=model_id, seq_id=seq_id)


# --------------------------------------------------------------------------------- REST resources
async def _run_json(state, m) -> dict:
    last = await run_in_threadpool(state.store.latest_checkpoint, m.model_id, "weights")
    last_s = await run_in_threadpool(state.store.latest_checkpoint, m.model_id, "sampler_weights")
    return {
        "training_run_id": m.model_id,
        "base_model": m.base_model,
        "model_owner": m.owner,
        "is_lora": m.is_lora,
        "corrupted": m.corrupted,
        "lora_rank": m.lora_rank,
        "last_request_time": _iso(m.last_request_at),
        "last_checkpoint": None if last is None else checkpoint_json(last),
        "last_sampler_checkpoint": None if last_s is None else checkpoint_json(last_s),
        "user_metadata": {k: str(v) for k, v in (m.user_metadata or {}).items()},
    }


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: Int64Query = 20, offset: Int64Query = 0, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    limit, offset = max(1, min(limit, 1000)), max(0, offset)
    page = await run_in_threadpool(state.store.list_models, caller.owner, limit, offset)
    return {"training_runs": [await _run_json(state, m) for m in page.items],
            "cursor": {"offset": offset, "limit": limit, "total_count": page.total}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    return await _run_json(state, await owned_model(state, caller, run_id, require_live=False))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    await owned_model(state, caller, run_id, require_live=False)
    items = await run_in_threadpool(state.store.list_checkpoints, run_id)
    return {"checkpoints": [checkpoint_json(c) for c in items]}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request, limit: Int64Query = 100, offset: Int64Query = 0, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    limit, offset = max(1, min(limit, 1000)), max(0, offset)
    page = await run_in_threadpool(state.store.list_user_checkpoints, caller.owner, limit, offset)
    return {"checkpoints": [checkpoint_json(c) for c in page.items],
            "cursor": {"offset": offset, "limit": limit, "total_count": page.total}}


async def _owned_checkpoint(state, caller: Caller, run_id: str, kind: str, name: str):
    if kind not in KINDS:
        raise InvalidInputError(f"checkpoint kind {kind!r} must be one of {', '.join(KINDS)}")
    ck = await run_in_threadpool(state.store.get_checkpoint, run_id, kind, name)
    if ck is None or ck.owner != caller.owner:
        raise NotFoundError(f"checkpoint tinker://{run_id}/{kind}/{name} not found")
    return ck


def remove_checkpoint_files(storage_path: str) -> None:
    import shutil

    shutil.rmtree(storage_path, ignore_errors=True)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    ck = await _owned_checkpoint(state, caller, run_id, kind, name)
    await run_in_threadpool(state.store.delete_checkpoint, run_id, kind, name)
    await run_in_threadpool(remove_checkpoint_files, ck.storage_path)
    return {}


@router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def publish(run_id: str, kind: str, name: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    ck = await _owned_checkpoint(state, caller, run_id, kind, name)
    if ck.public:
        raise ConflictError(f"checkpoint tinker://{run_id}/{kind}/{name} is already public")
    await run_in_threadpool(state.store.set_public, run_id, kind, name, True)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
async def unpublish(run_id: str, kind: str, name: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    ck = await _owned_checkpoint(state, caller, run_id, kind, name)
    if not ck.public:
        raise ConflictError(f"checkpoint tinker://{run_id}/{kind}/{name} is already private")
    await run_in_threadpool(state.store.set_public, run_id, kind, name, False)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_ttl(run_id: str, kind: str, name: str, body: TtlRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    await _owned_checkpoint(state, caller, run_id, kind, name)
    await run_in_threadpool(state.store.set_expires_at, run_id, kind, name, expiry_from_ttl(body.ttl_seconds))
    return {}


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    tp = parse_tinker_path(body.tinker_path, "tinker_path")
    await readable_checkpoint(state, caller, tp)
    run = await run_in_threadpool(state.store.get_model, tp.run_id)
    if run is None:
        raise NotFoundError(f"training run {tp.run_id!r} not found")
    lc = run.lora_config or {}
    return {"base_model": run.base_model, "is_lora": run.is_lora, "lora_rank": run.lora_rank,
            "train_unembed": lc.get("train_unembed"), "train_mlp": lc.get("train_mlp"),
            "train_attn": lc.get("train_attn"), "optimizer_config": normalize_optimizer_config(run.optimizer_config)}


def _hardlink_tree(src: str, dst: Path) -> None:
    """Copy a checkpoint directory by hard links: no bytes duplicated, yet deleting either
    copy leaves the other whole."""
    import os
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=os.link)


@router.post("/copy_weights")
async def copy_weights(body: CopyWeightsRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    """Copy a readable checkpoint into a new training run that cannot be trained on."""
    import uuid

    state = state_of(request)
    tp = parse_tinker_path(body.source_path, "source_path")
    ck = await readable_checkpoint(state, caller, tp)
    src = await run_in_threadpool(state.store.get_model, tp.run_id)
    if src is None:
        raise NotFoundError(f"training run {tp.run_id!r} of {body.source_path!r} not found")
    # The copy shares the source's files, but it is the caller's to keep after the source is
    # deleted (or, for a published checkpoint, after its owner deletes it): it counts in full.
    await run_in_threadpool(state.limits.check_storage, state.store, caller.owner, ck.size_bytes,
                            what=f"a copy of {body.source_path}")
    expires = expiry_from_ttl(body.ttl_seconds)
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise InvalidInputError("copy_weights with session_id needs model_seq_id too")
        await owned_session(state, caller, body.session_id)
        run_id = model_id_for(body.session_id, body.model_seq_id)
    else:
        run_id = f"copy-{uuid.uuid4()}:train:0"
    metadata = {"copied_from": body.source_path}
    if body.destination_project_id:
        metadata["project_id"] = body.destination_project_id
    _, created = await run_in_threadpool(lambda: state.store.create_model(
        run_id, owner=caller.owner, base_model=src.base_model, session_id=body.session_id,
        model_seq_id=body.model_seq_id, is_lora=src.is_lora, lora_rank=src.lora_rank, lora_config=src.lora_config,
        optimizer_config=src.optimizer_config, user_metadata=metadata))
    if not created:
        raise InvalidInputError(f"training run {run_id!r} already exists")
    await run_in_threadpool(state.store.update_model_status, run_id, "unloaded")
    dst = TinkerPath(run_id, tp.kind, tp.name)
    directory = checkpoint_directory(state.config.resolved_checkpoint_dir, dst)
    await run_in_threadpool(_hardlink_tree, ck.storage_path, directory)
    await run_in_threadpool(lambda: state.store.put_checkpoint(
        run_id, tp.kind, tp.name, owner=caller.owner, storage_path=str(directory), size_bytes=ck.size_bytes,
        expires_at=expires, user_metadata=ck.user_metadata))
    return {"tinker_path": str(dst)}


# --------------------------------------------------------------------------------- downloads
def _sign(secret: bytes, run_id: str, name: str, expires: int, kind: str = "external_weights") -> str:
    # External-weights links keep their original form (links handed out before stay valid);
    # links to other kinds name the kind too, so one link never opens another kind's files.
    if kind == "external_weights":
        return signed_links.sign(secret, run_id, name, expires)
    return signed_links.sign(secret, run_id, kind, name, expires)


def signed_file_urls(state, request: Request, ck) -> tuple[dict[str, str], int]:
    """A signed, expiring download link for every file of a checkpoint (filename -> URL)."""
    from urllib.parse import quote

    expires = int(time.time() + URL_LIFETIME.total_seconds())
    sig = _sign(state.secret, ck.run_id, ck.name, expires, ck.kind)
    base = (state.config.public_url or str(request.base_url)).rstrip("/")
    kind_part = "" if ck.kind == "external_weights" else f"{ck.kind}/"
    files = sorted(p.name for p in Path(ck.storage_path).iterdir() if p.is_file())
    return {f: f"{base}/api/v1/downloads/{quote(ck.run_id, safe='')}/{kind_part}{quote(ck.name)}/{expires}/{sig}/"
               f"{quote(f)}" for f in files}, expires


async def owned_checkpoint_files(state, request: Request, caller: Caller, run_id: str, kind: str, name: str) -> dict:
    """Download links for the files of a checkpoint the caller owns (the dashboard's download)."""
    ck = await _owned_checkpoint(state, caller, run_id, kind, name)
    urls, expires = await run_in_threadpool(signed_file_urls, state, request, ck)
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")
async def external_weights_urls(run_id: str, name: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    return await owned_checkpoint_files(state_of(request), request, caller, run_id, "external_weights", name)


async def _serve_file(request: Request, run_id: str, kind: str, name: str, expires: int, sig: str, filename: str):
    state = state_of(request)
    if expires < time.time() or not hmac.compare_digest(sig, _sign(state.secret, run_id, name, expires, kind)):
        return JSONResponse({"detail": "download link is invalid or expired"}, status_code=403)
    ck = await run_in_threadpool(state.store.get_checkpoint, run_id, kind, name)
    if ck is None:
        raise NotFoundError("checkpoint not found")
    path = Path(ck.storage_path) / filename
    if "/" in filename or filename.startswith(".") or not path.is_file():
        raise NotFoundError(f"file {filename!r} not found")
    return FileResponse(path, filename=filename)


@router.get("/downloads/{run_id}/{name}/{expires}/{sig}/{filename}")
async def download(run_id: str, name: str, expires: int, sig: str, filename: str, request: Request):
    """Signed, expiring, unauthenticated file download (what external_weights_urls hands out)."""
    return await _serve_file(request, run_id, "external_weights", name, expires, sig, filename)


@router.get("/downloads/{run_id}/{kind}/{name}/{expires}/{sig}/{filename}")
async def download_kind(run_id: str, kind: str, name: str, expires: int, sig: str, filename: str, request: Request):
    """Signed download of a training or sampler checkpoint's file (links from the dashboard)."""
    if kind not in KINDS:
        raise NotFoundError(f"checkpoint kind {kind!r} not found")
    return await _serve_file(request, run_id, kind, name, expires, sig, filename)
