"""Decoded custom losses kept in memory, least recently used dropped first.

The database holds every uploaded loss; this keeps the ones in use decoded, so a
``forward_backward`` does not decode its loss's graph again. A loss dropped here is decoded
again from its stored graph the next time it is used (after a restart, too).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tinsmith.custom_losses.program import CustomLoss

DEFAULT_CAPACITY = 1024


class CustomLossCache:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._losses: OrderedDict[str, CustomLoss] = OrderedDict()
        self._lock = threading.Lock()  # routes run in the event loop and in worker threads

    def get(self, loss_id: str) -> CustomLoss | None:
        with self._lock:
            loss = self._losses.get(loss_id)
            if loss is not None:
                self._losses.move_to_end(loss_id)
            return loss

    def put(self, loss_id: str, loss: CustomLoss) -> None:
        with self._lock:
            self._losses[loss_id] = loss
            self._losses.move_to_end(loss_id)
            while len(self._losses) > self.capacity:
                self._losses.popitem(last=False)
