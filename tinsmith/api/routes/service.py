"""Client configuration, health, capabilities and telemetry."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tinsmith.api.common import caller_of, state_of
from tinsmith.api.limits import limits_of
from tinsmith.api.request import ApiRoute

router = APIRouter(prefix="/api/v1", route_class=ApiRoute)

# Feature flags the SDK reads from client/config.
# custom_loss_server_side is set per server (--custom-loss-client-side turns it off), and so is
# use_pyqwest_transport (--client-http-transport).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    # One batched long-poll per sampling client (/retrieve_futures) instead of one per sample.
    "sample_use_retrieve_futures": True,
    "sample_join_sampling_session": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
}


@router.post("/client/config")
async def client_config(request: Request, _=Depends(caller_of)) -> dict:
    # The SDK splits forward_backward calls by these, so it never sends what the limits refuse.
    state = state_of(request)
    return {**CLIENT_CONFIG, "custom_loss_server_side": not state.config.custom_loss_client_side,
            "use_pyqwest_transport": state.config.client_http_transport == "pyqwest",
            **limits_of(state).sdk_chunking()}


@router.post("/client/dynamic_config")
async def dynamic_config(_=Depends(caller_of)) -> dict:
    # Abandoned samples are cancelled explicitly (/cancel_future), freeing the device at once.
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}


@router.get("/healthz")
async def healthz(request: Request):
    """200 while the server can run work; 503 with the reason once its device has failed."""
    state = state_of(request)
    fault = state.engine.fault or state.worker.fault()
    if fault is not None:
        return JSONResponse({"status": "unhealthy", "reason": f"device failed: {fault}; restart the server"},
                            status_code=503)
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request, _=Depends(caller_of)) -> dict:
    worker = state_of(request).worker
    models = []
    for name, base in worker.bases.items():
        models.append({"model_name": name, "max_context_length": base.config.max_position_embeddings,
                       "trainable": True, "sampleable": True})
    for alias, target in worker.aliases.items():
        base = worker.bases[target]
        models.append({"model_name": alias, "max_context_length": base.config.max_position_embeddings,
                       "trainable": True, "sampleable": True})
    return {"supported_models": models}


@router.post("/telemetry")
async def telemetry(_=Depends(caller_of)) -> dict:
    return {"status": "accepted"}
