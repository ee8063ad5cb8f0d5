"""Cancellations of sampling requests, posted from the event loop, honoured by the sampling thread.

The API posts a request's id the moment its client abandons it; the sampler looks at the board
before every decode step (one integer comparison while nothing was posted), drops the rows of
cancelled requests and frees their KV cache rows, so a cancelled request stops using the device
within one decode step. Ids leave the board when their request finishes, cancelled or not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from tinsmith.errors import TinsmithError


class SampleCancelled(TinsmithError):
    """The client cancelled the request (``cancel_future``) before it finished."""

    status = 409
    category = "user"


class CancelBoard:
    """Ids of requests to drop, shared by the threads that post them and the one that drops them.

    ``key_id`` maps the sampler's opaque task keys to the ids posted here.
    """

    def __init__(self, key_id: Callable[[Any], Hashable]):
        self._key_id = key_id
        self._ids: set[Hashable] = set()
        self._lock = threading.Lock()
        self.version = 0  # bumped by every post: lets readers skip the check when nothing changed

    def post(self, request_id: Hashable) -> None:
        with self._lock:
            self._ids.add(request_id)
            self.version += 1

    def forget(self, request_id: Hashable) -> None:
        """The request finished (or was dropped): nothing is left to cancel."""
        with self._lock:
            self._ids.discard(request_id)

    def wants(self, key: Any) -> bool:
        """Whether the task with this key is to be dropped."""
        return self._key_id(key) in self._ids

    def __len__(self) -> int:
        return len(self._ids)
