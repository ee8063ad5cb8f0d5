"""A tensor-parallel group whose follower ranks are Ray actors, so the ranks can span machines.

Ray only places and watches the processes; torch.distributed still does every collective.
Rank 0 stays in the caller's (the server's) process. A placement group reserves one bundle per
rank (one CPU, and one GPU on CUDA): bundle 0 is pinned to this node and holds rank 0's share,
so Ray never hands rank 0's GPU to another rank, and bundles 1..N-1 each hold one
:class:`RankActor`. ``STRICT_PACK`` (the default) keeps every rank on this node, which is what
tensor parallelism wants (a collective per layer); ``PACK`` or ``SPREAD`` let ranks go to
other nodes. The rendezvous is at this node's IP address. The actors' processes are started
(Ray spawns them, they import torch and tinsmith) before any rank joins the group, and only the
joining is held to the group's timeout: a short ``--parallel-timeout-s`` bounds each collective,
not how long a loaded node takes to start a process (:data:`ACTOR_START_S`).

There are no pipes between machines, so the doorbell that tells followers a call is coming
(:class:`~tinsmith.parallel.spmd.Doorbell`) is a Ray call: rank 0 calls each actor's
:meth:`RankActor.follow_call` before it broadcasts, and the actors (one call at a time, in
order) join the broadcast. An idle actor waits in Ray, not in a collective, so an idle server
keeps its ranks. Each actor also answers one :meth:`RankActor.watch` call, in its own
concurrency group, only when it is closed: when that call fails, Ray is saying the actor died
(killed, crashed, its node lost), which makes the group unhealthy exactly as a local follower
process that exited does.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tinsmith.errors import InvalidInputError
from tinsmith.gc_tuning import release_at_exit, tune_for_serving
from tinsmith.host_malloc import tune_for_serving as tune_malloc
from tinsmith.parallel.group import DEFAULT_TIMEOUT_S, ParallelError, TPGroup, free_port, init_tp_group
from tinsmith.parallel.spmd import SpmdExecutor
from tinsmith.parallel.worker import DrivenGroup

log = logging.getLogger(__name__)

OPTION = "--ray-address"
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_WATCH = "watch"  # the concurrency group of RankActor.watch, beside the default one that runs the calls
ACTOR_START_S = 120.0  # how long the actors' processes may take to start (or the group's timeout, if longer)


def connect_ray(address: str):
    """The ``ray`` module, connected to the cluster at ``address`` (``auto``: the one ``ray start``
    runs on this node). Already connected (a test's local cluster): used as it is."""
    try:
        import ray
    except ImportError as exc:
        raise InvalidInputError(f"{OPTION} needs Ray, which is not installed: pip install 'tinsmith[ray]'") from exc
    if not ray.is_initialized():
        if address != "auto":
            _check_answers(address)  # Ray itself would retry an address that does not answer for minutes
        try:
            ray.init(address=address)  # the actors' output is shown in the server's, prefixed with the actor
        except Exception as exc:  # ConnectionError, or ValueError for a malformed address
            raise InvalidInputError(f"{OPTION} {address}: no Ray cluster answers there "
                                    f"({type(exc).__name__}: {str(exc)[:300]}); start one with `ray start --head` "
                                    "and every node with `ray start --address HEAD:6379`") from exc
    return ray


def _check_answers(address: str, timeout_s: float = 5.0) -> None:
    """``HOST:PORT`` accepts a TCP connection (the Ray head's GCS port), or a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in address:
        raise InvalidInputError(f"{OPTION} must be auto or HOST:PORT (the Ray head's address, as `ray start --head` "
                                f"prints it), not {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise InvalidInputError(f"{OPTION} {address}: nothing answers there ({exc}); start the Ray head with "
                                "`ray start --head` and give the address it prints") from exc


class RankActor:
    """One follower rank inside a Ray actor: once started, it joins the group (:meth:`join`),
    builds its target (``make_target(tp, device)``) and runs the calls rank 0 sends it."""

    def __init__(self, threads: int, cuda: bool):
        tune_malloc()  # first, as the serving process does (tinsmith.host_malloc)
        torch.set_num_threads(threads)
        # Ray gave this actor one GPU and made it the only visible one.
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self._closed = threading.Event()

    def join(self, rank: int, world_size: int, init_method: str, timeout_s: float,
             make_target: Callable[[TPGroup, torch.device], Any]) -> None:
        self.tp = init_tp_group(rank, world_size, timeout_s=timeout_s, init_method=init_method, device=self.device)
        self.executor = SpmdExecutor(make_target(self.tp, self.device), self.tp)
        tune_for_serving()  # as rank 0's process: a collector's pause on one rank stalls them all

    def follow_call(self) -> bool:
        """Join the broadcast of rank 0's next call and run it; False when it was the stop."""
        return self.executor.follow_call()

    def watch(self) -> None:
        """Returns when the actor is closed; fails (in rank 0's hands) when the actor dies."""
        self._closed.wait()

    def where(self) -> str:
        """Which actor, process and node this is, for messages about it."""
        import ray

        return (f"Ray actor {ray.get_runtime_context().get_actor_id()[:12]}, process {os.getpid()} "
                f"on node {ray.util.get_node_ip_address()}")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        release_at_exit()
        self._closed.set()


class _ActorBell:
    """Rank 0's doorbell: one ``follow_call`` per follower actor before each broadcast. Their
    results are not read: a follower's failure is met by rank 0 in the call's collectives, and
    its death through the actor's ``watch``."""

    def __init__(self, actors: list):
        self.actors = actors

    def ring(self) -> None:
        for a in self.actors:
            a.follow_call.remote()


def _bundle(cuda: bool) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": 1.0} if cuda else {"CPU": 1.0}


class RayTPGroup(DrivenGroup):
    """``world_size`` ranks placed by Ray on the cluster at ``address``; this process is rank 0.

    ``cuda`` gives each rank one GPU (rank 0 the one Ray reserved for it on this node) and makes
    the group use NCCL; otherwise the ranks use one CPU each and gloo. ``strategy`` is the
    placement group's (``STRICT_PACK``: every rank on this node).
    """

    def __init__(self, world_size: int, address: str, make_target: Callable[[TPGroup, torch.device], Any], *,
                 cuda: bool = False, strategy: str = "STRICT_PACK", timeout_s: float = DEFAULT_TIMEOUT_S,
                 follower_threads: int = 1, label: str = "tensor-parallel"):
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group")
        if strategy not in STRATEGIES:
            raise InvalidInputError(f"--ray-placement-strategy must be one of {', '.join(STRATEGIES)}, "
                                    f"not {strategy!r}")
        ray = connect_ray(address)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.world_size, self.timeout_s, self.label = ray, world_size, timeout_s, label
        self._remove_pg = remove_placement_group
        ip = ray.util.get_node_ip_address()
        bundles = [_bundle(cuda) for _ in range(world_size)]
        bundles[0][f"node:{ip}"] = 0.001  # rank 0's bundle is on this node, where rank 0 runs
        self.pg = placement_group(bundles, strategy=strategy)
        self.actors: list = []
        self.places: list[str] = []  # each follower's actor, process and node, once they have started
        try:
            try:
                ray.get(self.pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
                raise InvalidInputError(
                    f"{OPTION}: the Ray cluster cannot place {world_size} ranks ({_bundle(cuda)} each, {strategy}, "
                    f"rank 0 on this node {ip}) within {timeout_s:g} s; free in the cluster: {free}") from None

            def in_bundle(i: int):
                return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

            device = torch.device("cpu")
            if cuda:
                gpu = ray.get(ray.remote(num_cpus=0, num_gpus=1)(_gpu_ids).options(
                    scheduling_strategy=in_bundle(0)).remote(), timeout=timeout_s)
                device = torch.device("cuda", _local_cuda_index(gpu[0]))
            actor_class = ray.remote(concurrency_groups={_WATCH: 1})(RankActor)
            self.actors = [actor_class.options(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0,
                                               scheduling_strategy=in_bundle(r))
                           .remote(follower_threads, cuda)
                           for r in range(1, world_size)]
            self._watches = [a.watch.options(concurrency_group=_WATCH).remote() for a in self.actors]
            start_s = max(timeout_s, ACTOR_START_S)
            try:
                self.places = ray.get([a.where.remote() for a in self.actors], timeout=start_s)
            except Exception as exc:  # never started (a node that cannot import tinsmith), or slower than that
                self._await_exits(1.0)
                raise ParallelError(self.exited() or f"the Ray actors of ranks 1..{world_size - 1} did not start "
                                    f"within {start_s:g} s; {exc}") from exc
            init_method = f"tcp://{ip}:{free_port()}"
            for r, a in enumerate(self.actors, start=1):  # a follower that fails to join fails rank 0's join below
                a.join.remote(r, world_size, init_method, timeout_s, make_target)
            try:
                tp = init_tp_group(0, world_size, timeout_s=timeout_s, init_method=init_method, device=device)
            except Exception as exc:
                self._await_exits(1.0)
                why = self.exited() or (f"the Ray actors of ranks 1..{world_size - 1} did not join within "
                                        f"{timeout_s:g} s (can their nodes import tinsmith and reach {init_method}?)")
                raise ParallelError(f"{why}; {exc}") from exc
            self._drive(tp, make_target(tp, device), _ActorBell(self.actors))
            log.info("%s ranks placed by Ray (%s): rank 0 in this process on node %s (%s); %s", label, strategy,
                     ip, device, "; ".join(f"rank {r}: {w}" for r, w in enumerate(self.places, start=1)))
        except BaseException:
            self._end_followers(0.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    def exited(self) -> str | None:
        ready, _ = self.ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
        gone = []
        for r, ref in enumerate(self._watches, start=1):
            if ref not in ready:
                continue
            try:
                self.ray.get(ref)
                why = "was closed"
            except Exception as exc:  # RayActorError: killed, crashed, or its node was lost
                why = f"died ({type(exc).__name__}: {_first_line(exc)})"
            where = f" ({self.places[r - 1]})" if self.places else " (a Ray actor)"
            gone.append(f"{self.label} rank {r} of {self.world_size}{where} {why}")
        return "; ".join(gone) or None

    def _await_exits(self, wait_s: float) -> None:
        self.ray.wait(self._watches, num_returns=len(self._watches), timeout=wait_s)

    def _end_followers(self, wait_s: float) -> None:
        if self.actors:
            closes = [a.close.remote() for a in self.actors]
            self.ray.wait(closes, num_returns=len(closes), timeout=wait_s)
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        self._remove_pg(self.pg)


def _gpu_ids() -> list:
    import ray

    return ray.get_gpu_ids()


def _local_cuda_index(gpu_id) -> int:
    """This process's CUDA index of the GPU Ray calls ``gpu_id`` (Ray counts the node's GPUs as
    ``CUDA_VISIBLE_DEVICES`` shows them to the raylet; this process may see a subset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        if not str(gpu_id).isdigit():
            raise InvalidInputError(f"{OPTION}: Ray reserved GPU {gpu_id} of this node for rank 0; start the "
                                    "server with CUDA_VISIBLE_DEVICES naming the GPUs as Ray does")
        return int(gpu_id)
    ids = [v.strip() for v in visible.split(",")]
    if str(gpu_id) not in ids:
        raise InvalidInputError(f"{OPTION}: Ray reserved GPU {gpu_id} of this node for rank 0, but this process "
                                f"sees only CUDA_VISIBLE_DEVICES={visible}")
    return ids.index(str(gpu_id))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [""])[0][:300]
