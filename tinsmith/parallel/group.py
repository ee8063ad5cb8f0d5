"""Setting up the tensor-parallel process group, with a timeout so a lost rank fails the others.

Every collective of the group goes through :func:`guarded`, which turns a backend error (a peer
that exited, raised and closed its sockets, or stalled past the timeout) into one
:class:`ParallelError` naming the operation and the rank, instead of an opaque backend message
or a hang.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0

T = TypeVar("T")


class ParallelError(RuntimeError):
    """A collective of the tensor-parallel group failed: a peer rank died, raised or stalled."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    ``group`` is the torch.distributed group the collectives run on (None: the default group).
    A group of size 1 runs no collective at all, so sharded code also runs in one process.
    """

    rank: int
    size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous share of ``n`` items (heads, columns, vocabulary rows)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def guarded(group: TPGroup, what: str, fn: Callable[[], T]) -> T:
    """Run one collective; a backend failure becomes a :class:`ParallelError` that says which."""
    try:
        return fn()
    except RuntimeError as exc:  # DistBackendError, DistNetworkError and gloo's timeouts are RuntimeErrors
        raise ParallelError(
            f"tensor-parallel {what} failed on rank {group.rank} of {group.size}: another rank exited, "
            f"raised or did not join within {group.timeout_s:g} s ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc


def free_port() -> int:
    """A TCP port free on this host now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_group(rank: int | None = None, world_size: int | None = None, *, backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
                  init_method: str | None = None) -> TPGroup:
    """Join (creating if needed) the default process group and return this rank's :class:`TPGroup`.

    ``rank`` and ``world_size`` default to the ``RANK`` / ``WORLD_SIZE`` environment variables
    (as torchrun sets them); the rendezvous reads ``MASTER_ADDR`` / ``MASTER_PORT`` unless
    ``init_method`` (``tcp://host:port``) names it. The backend
    is NCCL for a CUDA ``device`` and gloo otherwise. ``timeout_s`` bounds the rendezvous and
    every collective, so a rank that dies or hangs makes the others fail rather than wait forever.
    """
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    if backend is None:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            nccl_errors_fail_collectives()
        if backend == "nccl" and device is not None:
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    return TPGroup(rank=dist.get_rank(), size=dist.get_world_size(), timeout_s=timeout_s)


# How ProcessGroupNCCL's watchdog handles a collective that failed or passed the timeout: "2"
# aborts the communicator, so the collective (and every later one) raises on this rank and
# :func:`guarded` turns that into a ParallelError. PyTorch's default ("3") ends the process
# instead, and rank 0 is the server's own process.
NCCL_ERROR_HANDLING = "2"


def nccl_errors_fail_collectives() -> None:
    """Have a failed or timed-out NCCL collective raise here rather than end the process (unless
    the operator set ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); read when the process group is made."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)


def split_grid(world: TPGroup, tp_size: int) -> tuple[TPGroup, TPGroup]:
    """Cut the ``world`` group into replicas of ``tp_size`` ranks each: ranks ``d * tp_size ..
    (d + 1) * tp_size - 1`` shard replica ``d`` (its tensor-parallel group), and the ranks at the
    same place in every replica form a data-parallel group. Returns this rank's
    ``(tensor-parallel, data-parallel)`` groups. Every rank of ``world`` must call it, alike."""
    if world.size % tp_size:
        raise ValueError(f"{world.size} ranks do not form replicas of {tp_size}")
    replicas = world.size // tp_size
    timeout = timedelta(seconds=world.timeout_s)
    shard = replica = None
    for d in range(replicas):  # every rank creates every group, in the same order
        ranks = list(range(d * tp_size, (d + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if world.rank in ranks:
            shard = group
    for t in range(tp_size):
        ranks = list(range(t, world.size, tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if world.rank in ranks:
            replica = group
    return (TPGroup(world.rank % tp_size, tp_size, world.timeout_s, shard),
            TPGroup(world.rank // tp_size, replicas, world.timeout_s, replica))


def group_rank_zero(group: TPGroup) -> int:
    """The global rank of ``group``'s first rank (what torch.distributed's ``src`` arguments take)."""
    return 0 if group.group is None else dist.get_global_rank(group.group, 0)


def portable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (to travel to other ranks), else a RuntimeError
    with its type and message."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")
