"""Peak tensor memory of a block of torch code, on any device (CPU included).

CUDA has ``torch.cuda.max_memory_allocated``; the CPU allocator keeps no such statistic. This
mode sees every tensor an operator returns, counts its storage once while it lives (a finalizer
on the storage uncounts it when the last reference, autograd's saved tensors included, drops),
and records the high-water mark. Tensors that existed before the block are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as m: ...`` then ``m.peak_bytes`` (and ``m.live_bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:
            return
        self._sizes[key] = size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
