"""Signed, expiring download links: unauthenticated URLs that only this server can mint.

The SDK downloads some files (exported weights, session traces) with a plain HTTP GET, without
its API key; the link itself is the permission. A link names what it opens and when it expires,
signed with the server's secret (kept in the data dir, so links survive a restart).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import timedelta

LINK_LIFETIME = timedelta(hours=1)


def sign(secret: bytes, *parts: str | int) -> str:
    """The signature of a link naming ``parts`` (the kind of thing first, so links never cross kinds)."""
    return hmac.new(secret, "\n".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def new_expiry() -> int:
    """When a link minted now stops working (Unix seconds)."""
    return int(time.time() + LINK_LIFETIME.total_seconds())


def valid(secret: bytes, signature: str, expires: int, *parts: str | int) -> bool:
    """Whether a link's signature matches its parts and it has not expired."""
    return expires >= time.time() and hmac.compare_digest(signature, sign(secret, *parts, expires))
