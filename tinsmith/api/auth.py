"""API keys: who is calling, and therefore which sessions, runs and checkpoints they may see.

Keys travel in the ``X-API-Key`` header (the SDK's convention), or, for the OpenAI-compatible
routes, as ``Authorization: Bearer <key>`` (the OpenAI clients' convention). With a keys file only the
listed keys are accepted and each key is its own tenant. Without one, the server runs in local
single-user mode: any key with the SDK's ``tml-`` prefix is accepted and all share one owner.

The keys file, one key per line:

* blank lines, and lines whose first non-blank character is ``#``, are comments;
* otherwise the first whitespace-separated token is the key (a ``#`` inside it is part of it),
  optionally followed by the word ``admin`` (the key may see every key's runs on the dashboard,
  nothing more), then optionally by whitespace and a ``#`` comment;
* anything else on a line is an error naming the line number (the key itself is never shown).

The file is read at start-up (an error there stops the server) and again whenever it changes
(``reload_if_changed``, polled by the server) or on SIGHUP. A reload that fails keeps the keys
in force and logs one error; nothing in flight is interrupted either way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tinsmith.errors import AuthError
from tinsmith.tenants import OWNER_PREFIX

log = logging.getLogger(__name__)

LOCAL_OWNER = "local"


ADMIN_WORD = "admin"


@dataclass(frozen=True)
class Caller:
    owner: str  # stable tenant id (a hash of the key; never the key itself)
    # Marked ``admin`` in the keys file: may read every key's runs on the dashboard. Grants no
    # write access to other keys' runs or checkpoints through the API.
    admin: bool = False


def owner_for_key(key: str) -> str:
    return OWNER_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:24]


def parse_key_entries(text: str, source: str) -> list[tuple[str, bool]]:
    """(key, is admin) for every key a keys file lists (format in the module docstring);
    ValueError names the line (never the key)."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split(None, 1)
        if not fields or fields[0].startswith("#"):
            continue
        rest = fields[1] if len(fields) > 1 else ""
        admin = False
        words = rest.split(None, 1)
        if words and words[0] == ADMIN_WORD:
            admin, rest = True, words[1] if len(words) > 1 else ""
        if rest and not rest.startswith("#"):
            raise ValueError(
                f"api keys file {source} line {number}: unexpected text after the key "
                f"(one key per line, optionally followed by the word '{ADMIN_WORD}'; "
                "a comment after it must start with '#')"
            )
        entries.append((fields[0], admin))
    if not entries:
        raise ValueError(f"api keys file {source} lists no keys")
    return entries


def parse_keys(text: str, source: str) -> list[str]:
    """The keys a keys file lists (format in the module docstring); ValueError names the line."""
    return [key for key, _ in parse_key_entries(text, source)]


def read_keys_file(path: str | Path) -> dict[str, Caller]:
    """sha256(key) -> its caller for every key of the file; ValueError with a clear message otherwise."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read api keys file {str(path)!r}: {e}") from None
    return {hashlib.sha256(k.encode()).hexdigest(): Caller(owner_for_key(k), admin)
            for k, admin in parse_key_entries(text, repr(str(path)))}


def _signature(path: str) -> tuple[int, int, int] | str:
    """What changes when the file is edited or replaced (or the reason it cannot be read)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror}"
    return st.st_ino, st.st_mtime_ns, st.st_size


def key_from_headers(headers) -> str | None:
    """The API key of a request: ``X-API-Key``, else an ``Authorization: Bearer`` token.

    Either way the same key rules apply (``Authenticator.authenticate``).
    """
    key = headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class Authenticator:
    def __init__(self, keys_file: str | None = None):
        self.keys_file = keys_file
        self.keys: dict[str, Caller] | None = None
        self._reload_lock = threading.Lock()
        self._signature: tuple[int, int, int] | str | None = None
        self._reported: tuple[tuple[int, int, int] | str, str] | None = None  # the failure last logged
        if keys_file:
            self._signature = _signature(keys_file)
            self.keys = read_keys_file(keys_file)

    @property
    def multi_tenant(self) -> bool:
        return self.keys is not None

    def reload(self) -> bool:
        """Read the keys file again; True if the new keys are in force.

        On any failure the current keys stay and one error is logged. Swapping the mapping is a
        single assignment, so a request being authenticated sees the old or the new keys, whole.
        """
        return self._reload(only_if_changed=False)

    def reload_if_changed(self) -> bool:
        """Reload when the file was edited, replaced or removed since the last look.

        A file that stays broken is reported once, not at every look.
        """
        return self._reload(only_if_changed=True)

    def _reload(self, only_if_changed: bool) -> bool:
        # The look at the file's signature happens under the lock: a poll racing a SIGHUP reload
        # of the same edit must see the signature that reload recorded, or it reports it twice.
        if not self.keys_file:
            return False
        with self._reload_lock:
            signature = _signature(self.keys_file)
            if only_if_changed and signature == self._signature:
                return False
            self._signature = signature
            try:
                keys = read_keys_file(self.keys_file)
            except ValueError as e:
                if self._reported == (signature, str(e)):  # a SIGHUP after the poll saw this edit
                    log.warning("api keys file %s is unchanged and still does not load (reported above); "
                                "keeping the %d key(s) loaded before", self.keys_file, len(self.keys or {}))
                else:
                    log.error("%s; keeping the %d key(s) loaded before", e, len(self.keys or {}))
                self._reported = (signature, str(e))
                return False
            self.keys, self._reported = keys, None
        log.info("api keys reloaded from %s: %d key(s)", self.keys_file, len(keys))
        return True

    def authenticate(self, key: str | None) -> Caller:
        if not key:
            raise AuthError("missing X-API-Key header (set TINKER_API_KEY)")
        keys = self.keys
        if keys is None:
            if not (key.startswith("tml-") or key.startswith("eyJ")):
                raise AuthError("API keys must start with 'tml-'")
            return Caller(LOCAL_OWNER)
        digest = hashlib.sha256(key.encode()).hexdigest()
        for known, caller in keys.items():
            if hmac.compare_digest(known, digest):
                return caller
        raise AuthError("API key not accepted by this server")
