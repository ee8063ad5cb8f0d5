"""Typed errors raised by every layer; the API maps each class to one HTTP status.

Raising one of these means *nothing was applied*: callers validate before they mutate, so a
rejected request never leaves half-changed state behind for the caller or other tenants.
"""

from __future__ import annotations


class TinsmithError(Exception):
    """Base class. ``status`` is the HTTP status the API answers with."""

    status = 500
    category = "server"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInputError(TinsmithError):
    """The request is malformed or inconsistent (bad shape, id out of range, unknown loss...)."""

    status = 400
    category = "user"


class NotFoundError(TinsmithError):
    """An id (session, model, request, checkpoint, sampler) that does not exist for this caller."""

    status = 404
    category = "user"


class ConflictError(TinsmithError):
    """The operation conflicts with existing state (checkpoint name taken, already public...)."""

    status = 409
    category = "user"


class CapacityError(TinsmithError):
    """No room: adapter slots exhausted, rank above the server maximum, quota exceeded.

    Also every per-key hard cap (runs held, sampler snapshots held, checkpoint storage): only
    the caller can lift those, by freeing something, so they fail at once (a failed future, or a
    400 that the SDK does not retry) instead of a 429 that the SDK would retry for minutes."""

    status = 400
    category = "user"


class TooManyRequestsError(TinsmithError):
    """A transient per-key limit (requests in flight): the same request succeeds once some of the
    key's work has finished. The API answers 429 with ``Retry-After``; the SDK backs off and
    resubmits on its own, so the caller's code never sees this unless the limit persists."""

    status = 429
    category = "user"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StateLostError(TinsmithError):
    """The model's in-memory state is gone (e.g. the server restarted before it was saved)."""

    status = 410
    category = "user"


class ExpiredError(TinsmithError):
    """What was asked for existed but is no longer kept (e.g. a result past its retention time)."""

    status = 410
    category = "user"


class AuthError(TinsmithError):
    status = 401
    category = "user"
