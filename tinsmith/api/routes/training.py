"""Training runs: create_model, get_info, forward_backward / forward, optim_step, unload_model."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from tinsmith.api import codecs
from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, owned_model, owned_session, state_of, submit
from tinsmith.api.images import fit_forward_input
from tinsmith.api.limits import limits_of
from tinsmith.api.request import ApiRoute, json_object
from tinsmith.api.routes.custom_losses import resolve_custom_loss
from tinsmith.api.schemas import CreateModelRequest, ModelIdRequest, OptimStepRequest, UnloadModelRequest
from tinsmith.errors import CapacityError, InvalidInputError
from tinsmith.optim import check_params_match, normalize_optimizer_config, optimizer_type
from tinsmith.store.ids import model_id_for
from tinsmith.types import LoraSpec

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)


@router.post("/create_model")
async def create_model(body: CreateModelRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    session = await owned_session(state, caller, body.session_id)
    if session.is_finished:
        raise InvalidInputError(f"session {body.session_id!r} is finished; start a new ServiceClient")
    state.worker.resolve_base(body.base_model)  # 400 naming base_model if not served
    opt = normalize_optimizer_config(body.optimizer_config)  # 400 naming the supported types
    lora = None
    if body.lora_config is not None:
        c = body.lora_config
        if c.rank > state.config.max_lora_rank:
            raise CapacityError(f"lora_config.rank={c.rank} exceeds this server's --max-lora-rank {state.config.max_lora_rank}")
        if not (c.train_attn or c.train_mlp or c.train_unembed):
            raise InvalidInputError("lora_config must set at least one of train_attn, train_mlp, train_unembed")
        lora = LoraSpec(rank=c.rank, seed=c.seed, train_attn=c.train_attn, train_mlp=c.train_mlp,
                        train_unembed=c.train_unembed)
    model_id = model_id_for(body.session_id, body.model_seq_id)
    # Refuse before the run is recorded: a 429 must not leave a run behind with no request to create it.
    state.limits.admit(caller.owner, state.engine.in_flight(caller.owner))
    await run_in_threadpool(
        lambda: state.store.create_model(
            model_id, owner=caller.owner, base_model=body.base_model, session_id=body.session_id,
            model_seq_id=body.model_seq_id, is_lora=lora is not None, lora_rank=lora.rank if lora else None,
            lora_config=None if lora is None else {**body.lora_config.model_dump(), "alpha": lora.alpha},
            optimizer_config=opt, user_metadata=body.user_metadata,
        )
    )
    raw = body.model_dump_json().encode()
    return await submit(state, caller, "create_model", (body.base_model, lora, opt["type"]), payload=raw,
                        payload_type="json", model_id=model_id, seq_id=0)


@router.post("/get_info")
async def get_info(body: ModelIdRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    m = await owned_model(state, caller, body.model_id, require_live=False)
    family = state.worker.resolve_base(m.base_model).config.family
    return {
        "model_id": m.model_id,
        "model_data": {"arch": family, "model_name": m.base_model, "tokenizer_id": m.base_model},
        "is_lora": m.is_lora,
        "lora_rank": m.lora_rank,
        "model_name": m.base_model,
        "optimizer_config": normalize_optimizer_config(m.optimizer_config),
    }


async def _forward_backward(request: Request, caller: Caller, forward_route: bool) -> dict:
    state = state_of(request)
    body = await request.body()
    limits = limits_of(state)
    ctype = request.headers.get("content-type", "")
    if "protobuf" in ctype:
        model_id, seq_id, inp = await run_in_threadpool(
            lambda: codecs.decode_forward_backward_protobuf(body, limits=limits))
        wire, payload_type = "protobuf", "protobuf"
    else:
        obj = await json_object(request)
        model_id, seq_id, inp = await run_in_threadpool(
            lambda: codecs.decode_forward_backward_json(obj, limits=limits))
        wire, payload_type = "json", "json"
    if forward_route:
        inp.forward_only = True
    model = await owned_model(state, caller, model_id)
    await resolve_custom_loss(state, model, inp)
    base = state.worker.resolve_base(model.base_model)
    fit_forward_input(inp, model.base_model, base.config, base.image_token_counter)
    if any(d.images for d in inp.data):  # image tokens count too, now that the processor has made them
        limits.check_forward_tokens(sum(int(d.tokens.size) for d in inp.data))
    kind = "forward" if inp.forward_only else "forward_backward"
    return await submit(state, caller, kind, inp, payload=body, payload_type=payload_type, model_id=model_id,
                        seq_id=seq_id, wire=wire)


@router.post("/forward_backward")
async def forward_backward(request: Request, caller: Caller = Depends(caller_of)) -> dict:
    return await _forward_backward(request, caller, forward_route=False)


@router.post("/forward")
async def forward(request: Request, caller: Caller = Depends(caller_of)) -> dict:
    """SDK <= 0.22.2 sends forward passes here (newer SDKs use forward_backward + forward_only)."""
    return await _forward_backward(request, caller, forward_route=True)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    m = await owned_model(state, caller, body.model_id)
    params = body.params.to_params()
    params.validate()
    check_params_match(optimizer_type(m.optimizer_config), params, body.model_id)
    return await submit(state, caller, "optim_step", params, payload=json.dumps(body.model_dump()).encode(),
                        payload_type="json", model_id=body.model_id, seq_id=body.seq_id)


@router.post("/unload_model")
async def unload_model(body: UnloadModelRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    await owned_model(state, caller, body.model_id, require_live=False)
    return await submit(state, caller, "unload_model", None, payload=body.model_dump_json().encode(),
                        payload_type="json", model_id=body.model_id, seq_id=body.seq_id)
