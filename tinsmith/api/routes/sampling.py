"""Sampling: sampler weights snapshots, sampling sessions, ``asample``."""

from __future__ import annotations

import re
import uuid
from functools import partial

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from tinsmith.api import codecs
from tinsmith.api.auth import Caller
from tinsmith.api.common import (admit, caller_of, owned_model, owned_session, queue_stored, sampler_weights, state_of,
                                  submit)
from tinsmith.api.images import fit_sample_input
from tinsmith.api.limits import limits_of
from tinsmith.api.request import ApiRoute, json_object
from tinsmith.api.schemas import Body
from tinsmith.checkpoints.paths import TinkerPath, check_name, checkpoint_directory, expiry_from_ttl
from tinsmith.errors import InvalidInputError, NotFoundError
from tinsmith.server.operations import SampleArgs, SamplerSaveArgs
from tinsmith.store.ids import sampling_session_id_for

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)

INLINE_DECODE_BYTES = 1 << 14  # a larger asample body is decoded in a worker thread, images or not


class SaveForSamplerRequest(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    seq_id: int | None = None
    kind: str | None = None
    ttl_seconds: int | None = None
    user_metadata: dict | None = None


class CreateSamplingSessionRequest(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class JoinSamplingSessionRequest(Body):
    sampling_session_id: str


def _result_wire(request: Request) -> str:
    """SDKs up to 0.22.x read JSON sample results; newer ones require protobuf."""
    version = request.headers.get("x-stainless-package-version", "")
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m and tuple(int(x) for x in m.groups()) <= (0, 22, 999):
        return "json"
    return "protobuf"


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveForSamplerRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    m = await owned_model(state, caller, body.model_id)
    payload = body.model_dump_json().encode()
    if body.kind not in (None, "snapshot", "inflight"):
        raise InvalidInputError(f"kind must be 'snapshot' or 'inflight', not {body.kind!r}")
    if body.kind == "inflight" and body.path is not None:
        raise InvalidInputError("kind 'inflight' follows the live weights and has no stored path: send it without "
                                "path (save_weights_and_get_sampling_client(kind='inflight'))")
    if body.path is None:
        if body.sampling_session_seq_id is None or m.session_id is None:
            raise InvalidInputError("save_weights_for_sampler needs either path or sampling_session_seq_id")
        sid = sampling_session_id_for(m.session_id, body.sampling_session_seq_id)
        await run_in_threadpool(lambda: state.store.create_sampling_session(
            sid, owner=caller.owner, base_model=m.base_model, session_id=m.session_id, snapshot_of=m.model_id))
        args = SamplerSaveArgs(sampling_session_id=sid, inflight=body.kind == "inflight")
    else:
        name = check_name(body.path)
        tp = TinkerPath(body.model_id, "sampler_weights", name)
        expires = expiry_from_ttl(body.ttl_seconds)
        directory = checkpoint_directory(state.config.resolved_checkpoint_dir, tp)
        args = SamplerSaveArgs(name=name, tinker_path=str(tp), directory=directory, expires_at=expires,
                               user_metadata=body.user_metadata, owner=caller.owner)
    return await submit(state, caller, "save_weights_for_sampler", args, payload=payload, payload_type="json",
                        model_id=body.model_id, seq_id=body.seq_id)


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    await owned_session(state, caller, body.session_id)
    if body.base_model is None and body.model_path is None:
        raise InvalidInputError("create_sampling_session needs base_model or model_path")
    base_model, _ = await sampler_weights(state, caller, body.base_model, body.model_path)
    sid = sampling_session_id_for(body.session_id, body.sampling_session_seq_id)
    await run_in_threadpool(lambda: state.store.create_sampling_session(
        sid, owner=caller.owner, base_model=base_model, session_id=body.session_id, model_path=body.model_path))
    return {"sampling_session_id": sid}


@router.post("/join_sampling_session")
async def join_sampling_session(body: JoinSamplingSessionRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    s = await run_in_threadpool(state.store.get_sampling_session, body.sampling_session_id)
    if s is None or s.owner != caller.owner:
        raise NotFoundError(f"sampler {body.sampling_session_id!r} not found")
    return {"client_counter": await run_in_threadpool(state.store.join_sampling_session, body.sampling_session_id)}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    s = await run_in_threadpool(state.store.get_sampling_session, sampler_id)
    if s is None or s.owner != caller.owner:
        raise NotFoundError(f"sampler {sampler_id!r} not found")
    return {"sampler_id": s.sampling_session_id, "base_model": s.base_model, "model_path": s.model_path}


@router.post("/asample")
async def asample(request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    body = await request.body()
    limits = limits_of(state)
    obj = await json_object(request)
    decode = partial(codecs.decode_sample_request_json, obj, limits=limits)
    # Image chunks are decoded in full to check them: in a worker thread. A small prompt of tokens
    # alone takes microseconds, less than the hop to a thread.
    inline = len(body) <= INLINE_DECODE_BYTES and codecs.tokens_only(obj.get("prompt"))
    sid, seq_id, base_model, model_path, inp = decode() if inline else await run_in_threadpool(decode)
    snapshot_key = storage_path = None
    if sid is not None:
        s = state.store.cached_sampling_session(sid) or await run_in_threadpool(state.store.get_sampling_session, sid)
        if s is None or s.owner != caller.owner:
            raise NotFoundError(f"sampling_session_id {sid!r} not found")
        base_model, model_path = s.base_model, s.model_path
        if s.snapshot_of is not None:
            snapshot_key = s.sampling_session_id
    elif base_model is None and model_path is None:
        raise InvalidInputError("asample needs sampling_session_id (or base_model / model_path)")
    if model_path is not None:
        base_model, ck = await sampler_weights(state, caller, base_model, model_path)
        snapshot_key, storage_path = model_path, ck.storage_path
    base = state.worker.resolve_base(base_model or "")
    fit_sample_input(inp, base_model or "", base.config, base.image_token_counter)
    limits.check_sample(inp, base.config.max_position_embeddings)
    n, wire = inp.num_samples, _result_wire(request)
    args = SampleArgs(base_model or "", snapshot_key, storage_path, inp, [])
    if sid is None:
        args.sequence_ids = [f"direct:seq:{uuid.uuid4().hex}" for _ in range(n)]
        return await submit(state, caller, "sample", args, payload=body, payload_type="json", wire=wire,
                            submit_info={"sample_sequence_ids": args.sequence_ids})
    admit(state, caller, "sample", args)
    # The sampler's sequence numbers and the request are stored in one transaction.
    stored = await run_in_threadpool(lambda: state.store.create_sample_request(
        owner=caller.owner, sampling_session_id=sid, num_samples=n, payload=body, payload_type="json", seq_id=seq_id,
        submit_info_for=lambda first: {"sample_sequence_ids": [f"{sid}:seq:{first + i}" for i in range(n)]}))
    if stored is None:
        raise NotFoundError(f"sampling_session_id {sid!r} not found")
    rec, created = stored
    args.sequence_ids = list((rec.submit_info or {}).get("sample_sequence_ids", []))
    return queue_stored(state, caller, "sample", rec, created, args, wire)
