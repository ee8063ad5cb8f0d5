"""API keys: who is calling, and therefore which sessions, runs and checkpoints they may see.

Keys travel in the ``X-API-Key`` header (the SDK's convention). With a keys file only the
listed keys are accepted and each key is its own tenant. Without one, the server runs in local
single-user mode: any key with the SDK's ``tml-`` prefix is accepted and all share one owner.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from tinsmith.errors import AuthError

LOCAL_OWNER = "local"


@dataclass(frozen=True)
class Caller:
    owner: str  # stable tenant id (a hash of the key; never the key itself)


def owner_for_key(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


class Authenticator:
    def __init__(self, keys_file: str | None = None):
        self.keys: dict[str, str] | None = None
        if keys_file:
            self.keys = {}
            for line in Path(keys_file).read_text().splitlines():
                key = line.split("#", 1)[0].strip()
                if key:
                    self.keys[hashlib.sha256(key.encode()).hexdigest()] = owner_for_key(key)
            if not self.keys:
                raise ValueError(f"api keys file {keys_file!r} lists no keys")

    @property
    def multi_tenant(self) -> bool:
        return self.keys is not None

    def authenticate(self, key: str | None) -> Caller:
        if not key:
            raise AuthError("missing X-API-Key header (set TINKER_API_KEY)")
        if self.keys is None:
            if not (key.startswith("tml-") or key.startswith("eyJ")):
                raise AuthError("API keys must start with 'tml-'")
            return Caller(LOCAL_OWNER)
        digest = hashlib.sha256(key.encode()).hexdigest()
        for known, owner in self.keys.items():
            if hmac.compare_digest(known, digest):
                return Caller(owner)
        raise AuthError("API key not accepted by this server")
