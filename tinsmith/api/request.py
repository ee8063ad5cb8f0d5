"""How every route reads its request: one place for the body's encoding, size and JSON, and the URL.

Every router is built with :class:`ApiRoute`, so each handler receives an :class:`ApiRequest`:

* its body has its ``Content-Encoding`` undone (zstd, which the SDK uses for forward_backward)
  with ``--max-body-bytes`` applied to the decoded size too, read in pieces that stop at the
  limit, so a small compressed body cannot inflate to gigabytes (413);
* its JSON is parsed by :func:`tinsmith.api.codecs._common.parse_json`: bounded nesting, and
  no NUL characters or lone surrogates in any string (400 naming the field);
* its path and query parameters obey the same text rule (400 naming the parameter).

The size of the raw body on the wire is capped before any of this by ``BodyLimit`` (app.py).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import zstandard
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from tinsmith.api.codecs._common import check_text, parse_json
from tinsmith.errors import InvalidInputError, TinsmithError

DECODE_PIECE_BYTES = 1 << 20


class BodyTooLarge(TinsmithError):
    """A body above ``--max-body-bytes``, as sent or once its Content-Encoding is undone."""

    status = 413
    category = "user"


def too_large(what: str, limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"{what} exceeds the limit of {limit} bytes (--max-body-bytes)")


def decode_content(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo the ``Content-Encoding`` of a request body (``zstd`` or ``identity``).

    The decoded body may not exceed ``limit`` bytes: decoding stops (413) as soon as it would,
    so memory stays within about twice the limit whatever the compression ratio.
    """
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):  # the last-applied coding is listed last
        if coding == "identity":
            continue
        if coding != "zstd":
            raise InvalidInputError(f"Content-Encoding {coding!r} is not supported (use zstd or none)")
        body = _unzstd(body, limit)
    return body


def _unzstd(body: bytes, limit: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise InvalidInputError(f"body is not valid zstd data (Content-Encoding: zstd): {e}") from None
    if declared > limit:  # -1 when the frame does not say; then the reading below stops at the limit
        raise too_large(f"request body of {declared} bytes after zstd decompression", limit)
    pieces, size = [], 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
        while piece := reader.read(DECODE_PIECE_BYTES):
            size += len(piece)
            if size > limit:
                raise too_large("request body after zstd decompression", limit)
            pieces.append(piece)
    except zstandard.ZstdError as e:
        raise InvalidInputError(f"body is not valid zstd data (Content-Encoding: zstd): {e}") from None
    return b"".join(pieces)


class ApiRequest(Request):
    """A request whose ``body()`` is decoded within the size limit and whose ``json()`` is strict."""

    async def body(self) -> bytes:
        if not hasattr(self, "_decoded_body"):
            raw, encoding = await super().body(), self.headers.get("content-encoding")
            limit = self.app.state.tinsmith.config.max_body_bytes
            # decompressing up to the limit takes a while: off the event loop
            self._decoded_body = await run_in_threadpool(decode_content, raw, encoding, limit) if encoding else raw
        return self._decoded_body

    async def json(self) -> Any:
        if not hasattr(self, "_parsed_json"):
            self._parsed_json = parse_json(await self.body())
        return self._parsed_json


async def json_object(request: Request) -> dict[str, Any]:
    """The body of a route that parses its own JSON: an object (an empty body counts as ``{}``)."""
    obj = await request.json() if await request.body() else {}
    if not isinstance(obj, dict):
        raise InvalidInputError("request body must be a JSON object")
    return obj


def check_url_text(request: Request) -> None:
    """Path and query parameters obey the text rule of bodies (``%00`` decodes to a NUL)."""
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_text(value, f"path parameter {name}")
    for name, value in request.query_params.multi_items():
        check_text(value, f"query parameter {name}")


class ApiRoute(APIRoute):
    """A route that hands its handler an :class:`ApiRequest`, checked before FastAPI reads it.

    A JSON body is parsed here, ahead of FastAPI's own reading (which then reuses the result),
    so a refusal keeps its status and message instead of becoming a generic parsing error.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        reads_json = self.body_field is not None

        async def handler(request: Request) -> Response:
            request = ApiRequest(request.scope, request.receive)
            check_url_text(request)
            if reads_json and await request.body():
                await request.json()
            return await handle(request)

        return handler
