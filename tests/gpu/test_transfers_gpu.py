"""On the GPU: host data reaches the device without the host waiting for work queued before it,
and the page-locked blocks it is staged in are not reused before their copies have run.

What the decode loop and the training step rest on (``tinsmith.transfers.to_device``: page
tables, rows' adapters, group offsets, a request's tokens): a copy that waited for the stream
would empty the launch queue at every call, and nothing on the CPU can tell.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.gpu.conftest import DEVICE
from tinsmith.transfers import to_device

pytestmark = pytest.mark.gpu


def _cuda() -> torch.device:
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("needs a CUDA stream to queue work ahead of the copies")
    return torch.device(DEVICE)


def _busy_for(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """About a second of the device spinning, queued now; its start and end events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 31)
    end.record()
    return start, end


def test_to_device_does_not_wait_for_work_queued_before_it():
    device = _cuda()
    values = [[3, 1, 4, 1, 5], np.arange(300, dtype=np.int64), torch.arange(7, dtype=torch.float32)]
    for v in values:  # the host allocator's first page-locked blocks out of the way
        to_device(v, device)
    torch.cuda.synchronize()
    start, end = _busy_for(device)
    t = time.perf_counter()
    got = [to_device(v, device) for v in values] + [to_device(values[1], device, torch.int32),
                                                     to_device([], device, torch.long)]
    waited = time.perf_counter() - t
    torch.cuda.synchronize()
    busy = start.elapsed_time(end) / 1e3
    assert got[0].tolist() == values[0]
    assert got[1].tolist() == values[1].tolist() and got[3].dtype == torch.int32
    assert got[2].tolist() == values[2].tolist() and got[4].shape == (0,) and got[4].is_cuda
    assert busy > 0.2, "the queued work was too short to tell"
    assert waited < busy / 4, f"the copies waited {waited:.3f} s of the {busy:.3f} s queued before them"


def test_staging_blocks_are_not_reused_before_their_copies_run():
    """Many copies of one size queued behind a busy device: were a page-locked block handed on
    before its copy ran, a later copy's data would overwrite an earlier one's."""
    device = _cuda()
    torch.cuda.synchronize()
    _busy_for(device)
    sent = [np.full(1024, i, dtype=np.int64) for i in range(64)]
    got = [to_device(a, device) for a in sent]
    torch.cuda.synchronize()
    for i, g in enumerate(got):
        assert torch.equal(g.cpu(), torch.from_numpy(sent[i])), f"copy {i} holds another copy's data"

