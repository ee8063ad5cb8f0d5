"""Host data onto the device without making the host wait for the device.

``torch.tensor(values, device=cuda)`` and ``host.to(cuda)`` copy, then synchronise the stream:
the host waits for every kernel already queued, and the GPU then waits for the host to queue
more. In a loop of small steps (decode, a prefill's rows, a training request's datums) that
drains the launch queue at every copy. ``non_blocking=True`` drops torch's synchronisation, but
from ordinary (pageable) host memory the copy is still the driver's to stage, and CUDA documents
that it "might be synchronous with respect to host": the driver may wait for the stream before
it stages the data. Only a copy from page-locked (pinned) memory is asynchronous for certain, so
:func:`to_device` first copies host data into page-locked memory from torch's caching host
allocator, which keeps that block from being reused until the copy has run on the device (the
way vLLM and SGLang feed their steps). ``tinsmith.devtools.host_syncs`` finds the copies and
reads that still wait, a non-blocking copy from pageable memory included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` (a NumPy array or a host tensor too),
    copied without a stream synchronisation."""
    if isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        host = host if dtype is None else host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu")  # the host, whatever the default device
    return page_locked(host, device).to(device, non_blocking=True)


def page_locked(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` in page-locked memory when it is bound for a CUDA device, so that a non-blocking
    copy of it never waits for the stream; as it is elsewhere (a CPU, where there is nothing to
    wait for), while a CUDA graph is being captured (a captured copy would read the block again at
    every replay, after the allocator has handed it on: such a copy must come from a buffer of the
    graph's own), or where no page-locked memory can be had."""
    if (torch.device(device).type != "cuda" or host.device.type != "cpu" or not host.numel() or host.is_pinned()
            or torch.cuda.is_current_stream_capturing()):
        return host
    try:
        return host.pin_memory()
    except RuntimeError:  # page-locked memory exhausted: the copy may wait, but it is made
        return host


class HostCopies:
    """Device tensors on their way to the host, read when the host needs them.

    ``tensor.tolist()`` of a device tensor waits for everything queued on the stream, including
    work queued *after* the tensor was made. A sampler that queues its next decode burst before it
    reads the last one's tokens (so that the device never idles while the host records them) needs
    the read to wait for that burst only: on a GPU the tensors are copied into pinned host memory
    right behind the work that makes them (``non_blocking``: no wait) and an event marks the
    copies' end; :meth:`lists` waits for that event alone. On a CPU, where every operation has
    finished when it returns, the tensors are read as they are.
    """

    def __init__(self, tensors: list[torch.Tensor]):
        device = tensors[0].device if tensors else torch.device("cpu")
        self._event = None
        if device.type != "cuda":
            self._host = list(tensors)
            return
        try:
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        except RuntimeError:  # no page-locked memory to be had: read the device tensors (waits for all)
            self._host = list(tensors)
            return
        for host, t in zip(pinned, tensors):
            host.copy_(t, non_blocking=True)
        self._host = pinned
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def lists(self) -> list[list]:
        """Each tensor as nested Python lists (``tolist``), once its copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._host]
