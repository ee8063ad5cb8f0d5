"""Host data onto the device without making the host wait for the device.

``torch.tensor(values, device=cuda)`` and ``host.to(cuda)`` copy, then synchronise the stream:
the host waits for every kernel already queued, and the GPU then waits for the host to queue
more. In a loop of small steps (decode, a prefill's rows, a training request's datums) that
drains the launch queue at every copy. A copy with ``non_blocking=True`` does not wait: from
ordinary (pageable) host memory CUDA stages the data before the call returns, so the host
buffer may go at once, and the copy runs in stream order before anything that reads it.
``tinsmith.devtools.host_syncs`` finds the copies and reads that still wait.
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
    return host.to(device, non_blocking=True)

