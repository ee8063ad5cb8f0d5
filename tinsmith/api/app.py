"""The FastAPI application: routes, error mapping, start-up and shutdown."""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tinsmith.api.observe import RequestObserver, note_request
from tinsmith.api.request_rates import RequestRateLimit
from tinsmith.api.routes import ROUTERS
from tinsmith.errors import TinsmithError, TooManyRequestsError
from tinsmith.server.state import ServerState

log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


def _field_errors(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


class BodyLimit:
    """Answer 413 to any request whose body exceeds ``--max-body-bytes``, on every route.

    The JSON routes are parsed by FastAPI before any handler runs, so without this an
    oversized JSON body (even an unauthenticated one) would be buffered whole. A declared
    ``Content-Length`` is checked up front (the HTTP layer holds the client to it); a body sent
    without one is buffered only up to the limit, then replayed to the application.
    """

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._too_large(scope, receive, send, f"request body of {int(declared)} bytes")
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(scope, receive, send, "request body")
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, what: str) -> None:
        response = JSONResponse({"detail": f"{what} exceeds the limit of {self.limit} bytes (--max-body-bytes)"},
                                status_code=413)
        await response(scope, receive, send)


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
    app.add_middleware(BodyLimit, limit=state.config.max_body_bytes)
    # Before the body is read: a key over its request rate costs the loop as little as can be.
    app.add_middleware(RequestRateLimit, rates=state.request_rates, auth=state.auth,
                       routes=[route for router in ROUTERS for route in router.routes])
    app.add_middleware(RequestObserver, metrics=state.metrics)  # outermost: sees every answer, 413s too
    for router in ROUTERS:
        app.include_router(router)

    @app.exception_handler(TinsmithError)
    async def tinsmith_error(_: Request, exc: TinsmithError):
        note_request(reason=exc.message)
        headers = None
        if isinstance(exc, TooManyRequestsError):  # the SDK waits this long before resubmitting
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        note_request(reason=f"invalid request: {_field_errors(exc)}")
        return JSONResponse({"detail": f"invalid request: {_field_errors(exc)}"}, status_code=400)

    @app.exception_handler(ValidationError)
    async def body_validation_error(_: Request, exc: ValidationError):
        # A route that validates its body itself (e.g. an optional body): still the client's mistake.
        note_request(reason=f"invalid request: {_field_errors(exc)}")
        return JSONResponse({"detail": f"invalid request: {_field_errors(exc)}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        # Always a body: the SDK treats an empty 400 as a proxy failure and retries.
        note_request(reason=str(exc.detail))
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect):
        # The client went away before its body arrived (the SDK cancels a pending poll when a
        # client closes): nobody reads the answer, and it is no server error. 499 is nginx's
        # "client closed request", so the request log says what happened.
        note_request(reason="the client closed the connection before its request body arrived")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)

    return app
