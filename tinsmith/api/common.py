"""What every route shares: the server state, the caller, ownership checks, submissions."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tinsmith.api.auth import Caller
from tinsmith.api.observe import note_request
from tinsmith.api.request_rates import caller_found
from tinsmith.checkpoints.paths import parse_tinker_path
from tinsmith.engine.scheduler import Job
from tinsmith.errors import InvalidInputError, NotFoundError, StateLostError
from tinsmith.server.state import ServerState
from tinsmith.store.records import ModelRecord, RequestRecord, SessionRecord


def state_of(request: Request) -> ServerState:
    return request.app.state.tinsmith


async def caller_of(request: Request) -> Caller:
    api_key = request.headers.get("x-api-key")
    return caller_found(request.scope, api_key) or state_of(request).auth.authenticate(api_key)


async def owned_session(state: ServerState, caller: Caller, session_id: str) -> SessionRecord:
    s = await run_in_threadpool(state.store.get_session, session_id)
    if s is None or s.owner != caller.owner:
        raise NotFoundError(f"session {session_id!r} not found")
    return s


async def owned_model(state: ServerState, caller: Caller, model_id: str, *, require_live: bool = True) -> ModelRecord:
    m = await run_in_threadpool(state.store.get_model, model_id)
    if m is None or m.owner != caller.owner:
        raise NotFoundError(f"model {model_id!r} not found")
    if require_live and m.status == "lost":
        raise StateLostError(
            f"model {model_id!r} lost its unsaved state when the server restarted; "
            "load it from a checkpoint (create_training_client_from_state) to continue"
        )
    if require_live and m.status == "unloaded":
        raise InvalidInputError(f"model {model_id!r} was unloaded")
    return m


async def readable_checkpoint(state: ServerState, caller: Caller, tp, kind: str | None = None):
    """The stored checkpoint a tinker path names, if it is ready and the caller owns it or it is public."""
    if kind is not None and tp.kind != kind:
        raise InvalidInputError(f"{str(tp)!r} must name {kind} (tinker://RUN/{kind}/NAME)")
    ck = await run_in_threadpool(state.store.get_checkpoint, tp.run_id, tp.kind, tp.name)
    if ck is None or ck.status != "ready" or (ck.owner != caller.owner and not ck.public):
        raise NotFoundError(f"checkpoint {str(tp)!r} not found")
    return ck


def check_base_model_matches(state: ServerState, given: str | None, actual: str, source: str) -> None:
    """A request may name its base model beside a checkpoint (recipes do); the checkpoint decides.

    ``given`` must reach the same served model as ``actual`` (aliases count as the same);
    otherwise the request is refused naming both, never silently run on the other model.
    """
    if given is None or given == actual:
        return
    if state.worker.resolve_base(given) is not state.worker.resolve_base(actual):
        raise InvalidInputError(
            f"base_model {given!r} does not match the base model {actual!r} of {source!r}; "
            "pass the checkpoint's base model or leave base_model out"
        )


def request_tokens(kind: str, args: Any) -> int | None:
    """The tokens a request brings, for its log line: datum tokens of forward/backward, prompt
    tokens of a sample (times its samples, each decoded from the prompt); None for other kinds."""
    if kind in ("forward_backward", "forward"):
        return sum(len(d.tokens) for d in args.data)
    if kind == "sample":
        return len(args.input.prompt) * args.input.num_samples
    return None


async def sampler_weights(state, caller: Caller, base_model: str | None, model_path: str | None,
                          field: str = "model_path"):
    """The base model a sampler runs on, and the stored sampler weights it samples (if any).

    With ``model_path`` the checkpoint decides the base model; a ``base_model`` given beside it
    (cookbook recipes pass both) must name the same served model. Another key's private
    checkpoint is "not found", exactly like a missing one. ``field`` names the path in errors.
    """
    if model_path is None:
        state.worker.resolve_base(base_model or "")
        return base_model, None
    tp = parse_tinker_path(model_path, field)
    ck = await readable_checkpoint(state, caller, tp, "sampler_weights")
    run = await run_in_threadpool(state.store.get_model, tp.run_id)
    if run is None:
        raise NotFoundError(f"training run {tp.run_id!r} of {model_path!r} not found")
    check_base_model_matches(state, base_model, run.base_model, model_path)
    return run.base_model, ck


async def submit(
    state: ServerState,
    caller: Caller,
    kind: str,
    args: Any,
    *,
    payload: bytes,
    payload_type: str,
    model_id: str | None = None,
    seq_id: int | None = None,
    sampling_session_id: str | None = None,
    wire: str = "json",
    submit_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Persist the request (idempotent on its sequence key), then queue it; answer with its future.

    A key that already has its most requests queued or running gets a 429 first, before anything
    is stored: the SDK backs off and resubmits, so one key's flood never fills the queue for all.
    """
    admit(state, caller, kind, args, model_id)
    rec, created = await run_in_threadpool(
        lambda: state.store.create_request(
            owner=caller.owner, kind=kind, payload=payload, payload_type=payload_type, model_id=model_id,
            seq_id=seq_id, sampling_session_id=sampling_session_id, submit_info=submit_info,
        )
    )
    return queue_stored(state, caller, kind, rec, created, args, wire)


def admit(state: ServerState, caller: Caller, kind: str, args: Any, model_id: str | None = None) -> None:
    """Count the request for its log line and admit it under the key's limit (429 otherwise)."""
    note_request(run=model_id, tokens=request_tokens(kind, args))
    state.limits.admit(caller.owner, state.engine.in_flight(caller.owner))


def queue_stored(state: ServerState, caller: Caller, kind: str, rec: RequestRecord, created: bool, args: Any,
                 wire: str = "json") -> dict[str, Any]:
    """Queue a request just stored (``created``), or answer a replay with the stored request's
    future; either way the submit answer."""
    if not created and rec.kind != kind:
        # Only a replay of the same request may share its sequence number; answering with the
        # other request's future would hand the client a result of the wrong type.
        owner = rec.model_id if rec.model_id is not None else rec.sampling_session_id
        raise InvalidInputError(
            f"seq_id {rec.seq_id} of {owner!r} was already used by a {rec.kind} request ({rec.request_id}); "
            "every request of a run needs its own seq_id"
        )
    if created:
        # A sampler's retrieve_futures long-polls listen on its id: they wake when the job finishes.
        state.engine.submit(Job(rec.request_id, rec.kind, rec.model_id, rec.seq_id, args, wire, caller.owner,
                                topic=rec.sampling_session_id))
    answer: dict[str, Any] = {"request_id": rec.request_id}
    if rec.model_id is not None:
        answer["model_id"] = rec.model_id
    if rec.submit_info:
        answer.update(rec.submit_info)
    return answer
