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
    """No room: adapter slots exhausted, rank above the server maximum, quota exceeded."""

    status = 400
    category = "user"


class StateLostError(TinsmithError):
    """The model's in-memory state is gone (e.g. the server restarted before it was saved)."""

    status = 410
    category = "user"


class AuthError(TinsmithError):
    status = 401
    category = "user"
