"""age encryption of exported files (``save_weights_external(age_encryption_recipients=...)``).

The hosted service encrypts every exported file to the caller's age recipients and stores it
with a ``.age`` suffix, so that weights handed out through unauthenticated download links can
only be read by whoever holds a matching identity; tinker-cookbook's ``weights.download`` of a
training checkpoint relies on it. The format is age v1 (filippo.io/age), written by the
maintained ``pyrage`` binding; ``age -d -i IDENTITY`` or ``pyrage.decrypt`` read it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyrage

from tinsmith.errors import InvalidInputError

FIELD = "age_encryption_recipients"
SUFFIX = ".age"
MAX_RECIPIENTS = 10  # the SDK's documented limit
# An SSH RSA public key of 16384 bits is about 2,800 characters; anything longer is not a key.
MAX_RECIPIENT_LENGTH = 4096


def parse_recipients(values: Sequence[str] | None) -> list[Any]:
    """The age recipients named by ``values`` (``age1...`` X25519 keys or SSH public keys).

    Raises InvalidInputError naming the offending entry by its index (never echoing it: a
    pasted secret identity must not end up in logs); an empty or absent list means no
    encryption (an empty list is returned).
    """
    if not values:
        return []
    if len(values) > MAX_RECIPIENTS:
        raise InvalidInputError(f"{FIELD} has {len(values)} entries; at most {MAX_RECIPIENTS} are allowed")
    recipients = []
    for i, value in enumerate(values):
        where = f"{FIELD}[{i}]"
        if not isinstance(value, str) or not value.strip():
            raise InvalidInputError(f"{where} must be a non-empty age recipient string")
        if len(value) > MAX_RECIPIENT_LENGTH:
            raise InvalidInputError(f"{where} is {len(value)} characters long; an age recipient is at most "
                                    f"{MAX_RECIPIENT_LENGTH}")
        text = value.strip()
        try:
            if text.startswith("age1"):
                recipients.append(pyrage.x25519.Recipient.from_str(text))
            elif text.startswith(("ssh-ed25519 ", "ssh-rsa ")):
                recipients.append(pyrage.ssh.Recipient.from_str(text))
            else:
                raise InvalidInputError(f"{where} is not an age recipient: expected an X25519 "
                                        "key ('age1...') or an SSH public key ('ssh-ed25519 ...' or 'ssh-rsa ...')")
        except pyrage.RecipientError as e:
            raise InvalidInputError(f"{where} is not a valid age recipient: {e}") from None
    return recipients


def encrypt_files(directory: Path, recipients: Sequence[Any]) -> None:
    """Replace every file directly in ``directory`` by ``NAME.age``, encrypted to ``recipients``.

    Meant for a private temporary directory that is committed afterwards: no plaintext copy is
    left behind once it returns.
    """
    if not recipients:
        raise ValueError("encrypt_files needs at least one recipient")
    for plain in sorted(p for p in directory.iterdir() if p.is_file()):
        sealed = plain.with_name(plain.name + SUFFIX)
        pyrage.encrypt_file(str(plain), str(sealed), list(recipients))
        plain.unlink()
