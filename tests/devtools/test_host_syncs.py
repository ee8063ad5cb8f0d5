"""The host-sync finder itself: what it counts as a read or a copy on a CPU, and what it does not."""

from __future__ import annotations

import numpy as np
import torch

from tinsmith.devtools.host_syncs import HostSyncs
from tinsmith.transfers import to_device

DEV = torch.device("cpu")


def test_reads_of_device_tensors_count_and_host_tensors_do_not():
    x = torch.arange(6, device=DEV).float()  # made before the block: a device tensor
    with HostSyncs() as h:
        x.sum().item()
        x.tolist()
        bool(x[0] > 0)
        float(x[1])
        x.cpu().numpy()  # one read: what .cpu() returns is on the host
        host = torch.tensor([1.0, 2.0])  # made from host data: a host tensor
        host.tolist()
        torch.from_numpy(np.ones(1)).item()
    assert [e.what for e in h.events] == ["Tensor.item", "Tensor.tolist", "Tensor.__bool__", "Tensor.__float__",
                                          "Tensor.cpu"]
    assert h.count("read") == 5 and h.count("copy") == 0
    assert {e.where for e in h.events} == {"?"}  # asked from outside tinsmith


def test_a_wait_is_placed_at_the_tinsmith_line_that_asks_for_it():
    from tinsmith.models.moe import ExpertGroups

    groups = ExpertGroups(torch.tensor([2, 0, 3], device=DEV) * 1)
    with HostSyncs() as h:
        groups.host_counts  # reads the counts back
    (event,) = h.events
    assert (event.kind, event.what) == ("read", "Tensor.tolist") and event.where.startswith("models/moe.py:")


def test_data_dependent_operators_count_as_reads():
    x = torch.tensor([0, 3, 0, 5], device=DEV) * 1  # computed: a device tensor
    with HostSyncs() as h:
        x.nonzero()
        x[x > 0]
        torch.bincount(x)
        x.index_select(0, torch.arange(2, device=DEV))  # sized by its index: no read
        torch.repeat_interleave(torch.arange(4, device=DEV), x)  # sized by the sum of x: a read
        torch.repeat_interleave(torch.arange(4, device=DEV), x, output_size=8)  # told its size: no read
    assert [e.what for e in h.events] == ["nonzero", "boolean mask index", "bincount",
                                          "repeat_interleave without output_size"]


def test_copies_to_the_device_count_unless_made_by_to_device():
    """A blocking copy waits for the stream; a non-blocking one from pageable memory may (CUDA
    stages it); ``to_device`` stages host data in page-locked memory on a GPU, so it does not."""
    a = np.arange(4)
    with HostSyncs() as h:
        torch.tensor([1, 2], device=DEV)
        torch.from_numpy(a).to(DEV)
        torch.zeros(2, dtype=torch.long, device=DEV).copy_(torch.from_numpy(a[:2]))
        torch.from_numpy(a).to(DEV, non_blocking=True)
        torch.zeros(2, dtype=torch.long, device=DEV).copy_(torch.from_numpy(a[:2]), non_blocking=True)
        to_device([1, 2], DEV)
        to_device(a, DEV, torch.int32)
        to_device(torch.from_numpy(a), DEV)
        torch.tensor([1, 2], device="cpu")  # asked for the host itself: no copy
        torch.arange(3, device=DEV)  # made on the device: no copy
    assert [e.what for e in h.events] == ["torch.tensor", "Tensor.to", "Tensor.copy_", "Tensor.to (pageable, non_blocking)",
                                          "Tensor.copy_ (pageable, non_blocking)"]
    assert h.count("copy") == 5 and h.count("read") == 0


def test_work_on_host_tensors_alone_stays_on_the_host():
    """Factories without a device make host tensors (on a GPU too), and what is computed from host
    tensors alone is a host tensor: reading it waits for nothing. Moved to the device, or mixed
    with a device tensor, it is a device tensor again."""
    x = torch.arange(6, device=DEV) * 1  # on the device
    with HostSyncs() as h:
        rows = torch.cat([torch.arange(3).repeat_interleave(2), torch.zeros(2, dtype=torch.long)])
        torch.searchsorted(rows, torch.arange(0, 4, 2)).tolist()  # host work: no read
        (rows * 2).sum().item()  # no read
        moved = rows.to(DEV, non_blocking=True)  # pageable, non-blocking: a possible wait (a copy)
        moved.sum().item()  # on the device: a read
        (rows + x[:8].sum()).tolist()  # a device tensor mixed in: a read
        torch.full((2,), 1.0, device=DEV).tolist()  # made on the device: a read
    assert [(e.kind, e.what) for e in h.events] == [
        ("copy", "Tensor.to (pageable, non_blocking)"), ("read", "Tensor.item"), ("read", "Tensor.tolist"),
        ("read", "Tensor.tolist")]


def test_torch_is_itself_again_after_the_block():
    originals = (torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.to, torch.Tensor.item, torch.arange)
    with HostSyncs():
        assert torch.tensor is not originals[0] and torch.arange is not originals[-1]
    assert (torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.to, torch.Tensor.item,
            torch.arange) == originals
    t, r = torch.tensor([1.0]), torch.arange(3) * 2
    assert not hasattr(t, "_tinsmith_host") and not hasattr(r, "_tinsmith_host")


def test_torch_optims_own_step_counters_are_not_reads_but_an_optimizer_of_ours_is_watched():
    """AdamW reads its per-parameter step counts, which live on the host (not a wait on a GPU);
    an optimizer subclass of ours runs under torch.optim's step wrapper too, and its reads of
    device values count."""

    class ReadsANorm(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if float(p.grad.norm()) > 0:
                        p.add_(p.grad)

    ours, adamw = (torch.zeros(3, requires_grad=True) for _ in range(2))
    ours.grad, adamw.grad = torch.ones(3), torch.ones(3)
    optimizer = torch.optim.AdamW([adamw], foreach=True)
    with HostSyncs() as h:
        optimizer.step()
        optimizer.step()
    assert h.count() == 0, h.events
    with HostSyncs() as h:
        ReadsANorm([ours]).step()
    assert [e.what for e in h.events] == ["Tensor.__float__"], h.events
