"""The FastAPI application: routes, error mapping, start-up and shutdown."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinsmith.api.routes import ROUTERS
from tinsmith.errors import TinsmithError
from tinsmith.server.state import ServerState

log = logging.getLogger(__name__)


def _field_errors(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="tinsmith", lifespan=lifespan)
    app.state.tinsmith = state
    for router in ROUTERS:
        app.include_router(router)

    @app.exception_handler(TinsmithError)
    async def tinsmith_error(_: Request, exc: TinsmithError):
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return JSONResponse({"detail": f"invalid request: {_field_errors(exc)}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        # Always a body: the SDK treats an empty 400 as a proxy failure and retries.
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)

    return app
