"""Server-side custom losses: ``create_custom_loss``, and the loss a ``loss_fn: "custom"`` request names.

The SDK (``custom_loss_server_side`` in ``client/config``) uploads each loss once per session
as a torch.fx graph written out as data, and then sends ``forward_backward`` with
``loss_fn: "custom"`` and ``loss_fn_config: {"loss_id": ...}``. A loss belongs to the session
that created it: only that session's training runs may use it. It is stored durably, since a
session (and its ``LossHandle``) outlives a server restart.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.common import caller_of, owned_session, state_of
from tinsmith.api.request import ApiRoute
from tinsmith.api.schemas import CreateCustomLossRequest
from tinsmith.custom_losses import BoundCustomLoss, CustomLoss, RunLimits, decode_custom_loss
from tinsmith.custom_losses.interpreter import warm_up
from tinsmith.errors import CapacityError, InvalidInputError, NotFoundError
from tinsmith.server.state import ServerState
from tinsmith.store.ids import custom_loss_id_for
from tinsmith.store.records import ModelRecord
from tinsmith.types import ForwardBackwardInput

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)


def _decode(state: ServerState, name: object, inputs: object, graph: object) -> CustomLoss:
    warm_up()  # here, not in the worker's first run of the loss
    return decode_custom_loss(name, inputs, graph, max_nodes=state.config.custom_loss_max_nodes)


def _run_limits(state: ServerState) -> RunLimits:
    return RunLimits(max_elements=state.config.custom_loss_max_elements, timeout_s=state.config.custom_loss_timeout_s)


@router.post("/create_custom_loss")
async def create_custom_loss(body: CreateCustomLossRequest, request: Request, caller: Caller = Depends(caller_of)) -> dict:
    state = state_of(request)
    if state.config.custom_loss_client_side:
        raise InvalidInputError("this server runs custom losses on the client (--custom-loss-client-side)")
    session = await owned_session(state, caller, body.session_id)
    if session.is_finished:
        raise InvalidInputError(f"session {body.session_id!r} is finished; start a new ServiceClient")
    loss = await run_in_threadpool(_decode, state, body.name, body.inputs, body.graph)
    loss_id = custom_loss_id_for(body.session_id, body.custom_loss_seq_id)

    def store_loss() -> str:
        store = state.store
        if store.get_custom_loss(loss_id) is None:
            limit = state.config.custom_loss_max_per_session
            if store.count_session_custom_losses(body.session_id) >= limit:
                raise CapacityError(
                    f"session {body.session_id!r} already created {limit} custom losses, this server's "
                    "limit (--custom-loss-max-per-session)"
                )
        store.create_custom_loss(loss_id, session_id=body.session_id, custom_loss_seq_id=body.custom_loss_seq_id,
                                 owner=caller.owner, name=body.name, inputs=body.inputs, graph=body.graph)
        # The SDK reads the answer through a future, like every other creating call.
        rec, _ = store.create_request(owner=caller.owner, kind="create_custom_loss",
                                      payload=body.model_dump_json().encode(), payload_type="json")
        result = {"loss_id": loss_id, "type": "create_custom_loss"}
        store.complete_request(rec.request_id, json.dumps(result).encode(), "application/json")
        return rec.request_id

    request_id = await run_in_threadpool(store_loss)
    state.custom_losses.put(loss_id, loss)
    return {"request_id": request_id}


async def resolve_custom_loss(state: ServerState, model: ModelRecord, inp: ForwardBackwardInput) -> None:
    """Attach the loss a ``loss_fn: "custom"`` request names to it, or refuse the request.

    The loss must have been created in the session the training run belongs to.
    """
    if inp.loss_fn != "custom":
        return
    loss_id = inp.loss_fn_config.get("loss_id")
    if not isinstance(loss_id, str) or not loss_id:
        raise InvalidInputError("loss_fn 'custom' needs loss_fn_config['loss_id'], the id create_custom_loss returned")
    extra = sorted(set(inp.loss_fn_config) - {"loss_id"})
    if extra:
        raise InvalidInputError(f"loss_fn_config keys {extra} are not used by loss_fn 'custom' (allowed: loss_id)")
    # Ids come from custom_loss_id_for, so a cached loss of this run's session has its prefix;
    # any other id goes to the database, which tells another key's loss (404) from another
    # session's (400).
    loss = state.custom_losses.get(loss_id) if loss_id.startswith(f"{model.session_id}:loss:") else None
    if loss is None:
        rec = await run_in_threadpool(state.store.get_custom_loss, loss_id)
        if rec is None or rec.owner != model.owner:
            raise NotFoundError(f"custom loss {loss_id!r} not found")
        if rec.session_id != model.session_id:
            raise InvalidInputError(_other_session(loss_id, rec.session_id, model))
        loss = await run_in_threadpool(_decode, state, rec.name, rec.inputs, rec.graph)
        state.custom_losses.put(loss_id, loss)
    inp.custom_loss = BoundCustomLoss(loss_id, loss, _run_limits(state))


def _other_session(loss_id: str, loss_session: str, model: ModelRecord) -> str:
    return (f"custom loss {loss_id!r} was created in session {loss_session!r}; training run {model.model_id!r} "
            f"(session {model.session_id!r}) can only use losses its own session created")
