"""Start the ranks of a tensor-parallel group as local processes (tests and benchmarks).

Each rank runs ``fn(tp, *args)`` in a fresh process (forked from a clean fork server) after joining the group; what it
returns (or the error it raised, as text) is written to ``out_dir/rank{r}.pt`` for the parent.
A rank still running at the deadline is killed and reported, so a hung group cannot hang the
caller.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tinsmith.parallel.group import TPGroup, free_port, init_tp_group


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None  # None: killed at the deadline
    result: Any = None
    error: str | None = None  # the rank's traceback when it raised


def _entry(fn: Callable, rank: int, world: int, port: int, out_dir: str, timeout_s: float, threads: int,
           args: tuple, device: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        tp = init_tp_group(timeout_s=timeout_s, device=None if device is None else torch.device(device))
        result = fn(tp, *args)
        torch.save({"result": result}, path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise SystemExit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, out_dir: Path, args: tuple = (), *, timeout_s: float = 30.0,
              deadline_s: float = 120.0, threads: int = 1, devices: list[str] | None = None) -> list[RankOutcome]:
    """Run ``fn`` on ``world_size`` ranks: gloo, or NCCL with rank ``r`` on ``devices[r]`` (CUDA
    devices); ``timeout_s`` is the group's collective timeout, ``deadline_s`` how long the caller
    waits for all of them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    # The fork server imports torch (and ``fn``'s module) once; each rank is then forked from it,
    # not started from scratch, which saves seconds per group (nothing runs there before a fork).
    ctx.set_forkserver_preload(["torch", __name__, fn.__module__])
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, str(out_dir), timeout_s, threads, args,
                                              None if devices is None else devices[r]))
             for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    outcomes = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            outcomes.append(RankOutcome(r, None, error="killed at the deadline"))
            continue
        path = out_dir / f"rank{r}.pt"
        saved = torch.load(path, weights_only=False) if path.exists() else {}
        outcomes.append(RankOutcome(r, p.exitcode, saved.get("result"), saved.get("error")))
    return outcomes
