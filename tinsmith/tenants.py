"""Short, stable, non-secret names for tenants, fit for logs and metric labels.

A tenant (``owner``) is ``key-`` followed by 24 hex digits of the SHA-256 of its API key
(``tinsmith.api.auth.owner_for_key``), or ``local`` in single-user mode. Its *key id* is the first
8 of those digits: short enough to read in a log line, stable across restarts, and the same for
the key itself (:func:`key_id_for_api_key`), yet it reveals nothing of the key.
"""

from __future__ import annotations

import hashlib

KEY_ID_LENGTH = 8
OWNER_PREFIX = "key-"


def key_id(owner: str) -> str:
    """The key id of an owner string (``local`` stays ``local``; an empty owner is ``-``)."""
    if owner.startswith(OWNER_PREFIX):
        return owner[len(OWNER_PREFIX):len(OWNER_PREFIX) + KEY_ID_LENGTH]
    return owner or "-"


def key_id_for_api_key(api_key: str) -> str:
    """The key id of an API key as sent by a client: equals ``key_id`` of the owner it maps to."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:KEY_ID_LENGTH]
