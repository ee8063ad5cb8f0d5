"""A tensor-parallel worker group on one host: rank 0 in the caller's process, the other ranks
in child processes that follow it.

The engine keeps talking to one object in its own process: :class:`LocalTPGroup` ``.call`` runs
a method of every rank's :class:`RankWorker` (its sharded training runtime and sampler) through
the :class:`SpmdExecutor`. A follower that dies, or any collective that fails, marks the group
unhealthy (:attr:`DrivenGroup.healthy`); it must then be closed and started again, which is
what a server's health check would report and act on.
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinsmith.gc_tuning import release_at_exit, tune_for_serving
from tinsmith.host_malloc import tune_for_serving as tune_malloc
from tinsmith.parallel.group import DEFAULT_TIMEOUT_S, ParallelError, TPGroup, free_port, init_tp_group
from tinsmith.parallel.runtime import TPTrainingRuntime
from tinsmith.parallel.sampling import ShardedSampler
from tinsmith.parallel.shard import load_shard
from tinsmith.parallel.spmd import Doorbell, SpmdExecutor
from tinsmith.sampling.sampler import SampleTask


class RankWorker:
    """What every rank holds: its shard of the model, the training runtime and the sampler over it."""

    def __init__(self, model_dir: str, tp: TPGroup, dtype: torch.dtype, runtime_kwargs: dict):
        model = load_shard(model_dir, tp, dtype).model
        self.runtime = TPTrainingRuntime(model, **runtime_kwargs)
        self.sampler = ShardedSampler(model, _decoder(model_dir))

    def train(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A :class:`TPTrainingRuntime` method (forward_backward, optim_step, create_adapter...)."""
        return getattr(self.runtime, method)(*args, **kwargs)

    def sample(self, tasks: list[SampleTask]) -> list:
        """Run ``tasks`` to completion; ``(key, result or error)`` in finishing order. Each sampler
        step runs to completion, so every rank runs the same decode steps (no time budget)."""
        for t in tasks:
            self.sampler.add(t)
        done: list = []
        while self.sampler.has_work():
            done += self.sampler.step(budget_s=float("inf"))
        return done


def _decoder(model_dir: str):
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return lambda ids: ""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def _rank_worker(model_dir: str, dtype: torch.dtype, runtime_kwargs: dict, tp: TPGroup,
                 device: torch.device) -> RankWorker:
    return RankWorker(model_dir, tp, dtype, runtime_kwargs)


class _DriverBell:
    """Rank 0's end of one pipe per follower: a byte before each call."""

    def __init__(self, conns: list, world_size: int, label: str = "tensor-parallel"):
        self.conns, self.world_size, self.label = conns, world_size, label

    def ring(self) -> None:
        for r, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(b"\x01")
            except OSError as exc:
                raise ParallelError(f"{self.label} rank {r} of {self.world_size} cannot be reached "
                                    f"({type(exc).__name__}: {exc})") from exc


class _FollowerBell:
    """A follower's end: it waits here between calls, with no timeout (an idle server is fine)."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self) -> bool:
        try:
            self.conn.recv_bytes()
            return True
        except (EOFError, OSError):  # rank 0 exited
            return False


def _follower(rank: int, world: int, init_method: str, timeout_s: float, make_target: Callable, threads: int,
              device: torch.device, bell) -> None:
    tune_malloc()  # first, as the serving process does (tinsmith.host_malloc)
    torch.set_num_threads(threads)
    tp = init_tp_group(rank, world, timeout_s=timeout_s, init_method=init_method, device=device)
    try:
        executor = SpmdExecutor(make_target(tp, device), tp, doorbell=_FollowerBell(bell))
        tune_for_serving()  # as rank 0's process: a collector's pause on one rank stalls them all
        executor.follow()
    finally:
        dist.destroy_process_group()
        release_at_exit()


class DrivenGroup(ABC):
    """Rank 0's side of a tensor-parallel group: this process drives the executor, the followers
    run elsewhere (:class:`LocalTPGroup`: child processes; ``tinsmith.parallel.ray_group``: Ray
    actors). Subclasses say how followers are found gone (:meth:`exited`), waited for and ended."""

    world_size: int
    timeout_s: float
    label: str = "tensor-parallel"  # what the group is called in messages ("data-parallel" for replicas)

    def _drive(self, tp: TPGroup, target: Any, doorbell: Doorbell) -> None:
        """Rank 0 has joined the group as ``tp``: calls go through an executor over ``target``."""
        self.tp = tp
        self.executor = SpmdExecutor(target, tp, doorbell=doorbell)
        self.worker = self.executor.target
        self._failed: ParallelError | None = None

    @property
    def healthy(self) -> bool:
        """False once a collective failed or a follower is gone."""
        return self._failed is None and self.exited() is None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``target.method`` on every rank; rank 0's result (its error re-raised)."""
        if self._failed is None and (gone := self.exited()):  # found before a collective has to time out
            self._failed = ParallelError(gone)
            raise self._failed
        if self._failed is not None:
            raise ParallelError(f"the {self.label} group is down ({self._failed}); restart it")
        try:
            return self.executor.call(method, *args, **kwargs)
        except ParallelError as exc:
            self._await_exits(1.0)  # a rank that died may close its sockets before it is reported gone
            gone = self.exited()  # a collective failed because a rank died: say which one
            self._failed = ParallelError(f"{gone}; {exc}") if gone else exc
            if gone:
                raise self._failed from exc
            raise

    @abstractmethod
    def exited(self) -> str | None:
        """Which follower ranks are gone, in words (None: all are running)."""

    @abstractmethod
    def _await_exits(self, wait_s: float) -> None:
        """Give followers that are dying up to ``wait_s`` to be reported gone."""

    @abstractmethod
    def _end_followers(self, wait_s: float) -> None:
        """After the stop (or without it, when they cannot hear it): let them exit, then end them."""

    @property
    def failure(self) -> str | None:
        """Why the group cannot run calls (a rank exited, a collective failed); None while healthy."""
        if self._failed is not None:
            return str(self._failed)
        return self.exited()

    def close(self, wait_s: float = 10.0) -> None:
        """Release the followers (when they can still hear it) and leave the group."""
        if self.healthy:
            try:
                self.executor.stop()
            except ParallelError:
                pass
        self._end_followers(wait_s)
        if dist.is_initialized():
            dist.destroy_process_group()


class LocalTPGroup(DrivenGroup):
    """``world_size`` ranks on this host; this process is rank 0 (the driver).

    Every rank holds a :class:`RankWorker` of ``model_dir``, or what ``make_target(tp, device)``
    builds (a module-level callable: the followers are started from a fork server). ``devices``
    gives each rank its device (default: the CPU); a CUDA device makes the group use NCCL.
    """

    def __init__(self, model_dir: str | None, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 dtype: torch.dtype = torch.float32, runtime_kwargs: dict | None = None, follower_threads: int = 1,
                 make_target: Callable[[TPGroup, torch.device], Any] | None = None,
                 devices: list[torch.device] | None = None, label: str = "tensor-parallel"):
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group")
        if make_target is None:
            make_target = rank_worker_factory(str(model_dir), dtype, runtime_kwargs)
        devices = devices or [torch.device("cpu")] * world_size
        self.timeout_s, self.world_size, self.label = timeout_s, world_size, label
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", __name__, make_target.__module__])
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, world_size)]  # (follower's end, rank 0's end)
        self.procs = [ctx.Process(target=_follower, daemon=True,
                                  args=(r, world_size, init_method, timeout_s, make_target, follower_threads,
                                        devices[r], pipes[r - 1][0]))
                      for r in range(1, world_size)]
        for p in self.procs:
            p.start()
        for theirs, _ in pipes:
            theirs.close()  # the follower holds its end; rank 0 exiting closes ours, which ends the follower
        tp = init_tp_group(0, world_size, timeout_s=timeout_s, init_method=init_method, device=devices[0])
        self._drive(tp, make_target(tp, devices[0]), _DriverBell([ours for _, ours in pipes], world_size, label))

    def exited(self) -> str | None:
        gone = [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
        return "; ".join(f"{self.label} rank {r} of {self.world_size} (process {p.pid}) exited with code "
                         f"{p.exitcode}" for r, p in gone) or None

    def _await_exits(self, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))

    def _end_followers(self, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def rank_worker_factory(model_dir: str, dtype: torch.dtype = torch.float32,
                        runtime_kwargs: dict | None = None) -> Callable[[TPGroup, torch.device], RankWorker]:
    """``make_target`` for a group whose ranks each hold a :class:`RankWorker` of ``model_dir``."""
    return functools.partial(_rank_worker, model_dir, dtype, runtime_kwargs or {})
