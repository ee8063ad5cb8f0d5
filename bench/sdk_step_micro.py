"""Micro-benchmark: what a training step costs through the SDK beyond its own compute.

A training loop through the SDK (``forward_backward`` then ``optim_step``, each step's results
awaited before the next is sent) pays, on every step, for what the same step in process does not:
the requests' way in (HTTP, decoding, storing them), the engine's dispatch, storing each outcome
before it is answered, and the answers' way back. On a GPU the device waits through all of it
(the fourth H200 run: 0.578x of the in-process tokens/s at 8 x 1024, docs/performance.md). Here
the step is made tiny (a micro Qwen3, one datum of 16 tokens, LoRA rank 8) so that the rest is
what shows.

Every checkout of ``--checkouts`` (this one by default; e.g. ``/tmp/base,.`` for a worktree of an
earlier commit beside this one) serves every database of ``--databases``: the servers all start
first (pinned to one core with one thread, this client on the other), then take turns round by
round, so that a before/after comparison is one run on one machine and its drift falls on every
server alike. Per server: the rounds' median step, its server and client CPU, and on SQLite the
server's own account of the steps (``bench.gpu.sample.training_step_parts``: the
forward_backward's wait and run, the optim_step's wait after it and its run, the rest outside the
server); and the same step in process, on the servers' core, for scale.

    python bench/sdk_step_micro.py [--checkouts .] [--databases sqlite,postgres] [--steps 40] [--rounds 4]
                                   [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_times import cpu_seconds, own_cpu_seconds  # noqa: E402
from bench.gpu.sample import training_step_parts  # noqa: E402
from bench.result_writes_micro import postgres_if_asked  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402

SHAPE = TinyShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16, num_attention_heads=2,
                  num_key_value_heads=1)
CLIENT_CORE, SERVER_CORE = 0, 1


class SdkTrainer:
    """One server (of ``checkout``, on ``database_url``; None: SQLite) and a LoRA training client
    of it, taking awaited steps on one 16-token datum."""

    def __init__(self, model: Path, data_dir: Path, checkout: Path, database_url: str | None, core: int | None):
        import tinker

        from tests.e2e.helpers import sft_batch

        self.database = None if database_url else data_dir / "tinsmith.sqlite"
        self.srv = ServerProcess(model, data_dir, database_url=database_url, extra_args=["--device", "cpu"],
                                 env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, checkout=checkout)
        self.srv.start(timeout=600)
        if core is not None:
            subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(self.srv.proc.pid)], check=True,
                           capture_output=True)
        self.service = tinker.ServiceClient(base_url=self.srv.base_url, api_key="tml-bench-sdk-step")
        self.client = self.service.create_lora_training_client(base_model=str(model), rank=8).result(timeout=600)
        self.data = sft_batch(0, 1, 16, 200)

    def step(self) -> None:
        from tinker import types

        fb = self.client.forward_backward(self.data, "cross_entropy")
        op = self.client.optim_step(types.AdamParams(learning_rate=1e-5))
        fb.result(timeout=600)
        op.result(timeout=600)

    def timed(self, steps: int) -> dict:
        """``steps`` awaited steps: the median step, CPU a step, and the server's parts (SQLite)."""
        cpu, start, walls = (cpu_seconds(self.srv.proc.pid), own_cpu_seconds()), time.time(), []
        for _ in range(steps):
            t = time.perf_counter()
            self.step()
            walls.append(time.perf_counter() - t)
        median = statistics.median(walls)
        out = {"step_ms": 1e3 * median,
               "server_cpu_ms_per_step": 1e3 * (cpu_seconds(self.srv.proc.pid) - cpu[0]) / steps,
               "client_cpu_ms_per_step": 1e3 * (own_cpu_seconds() - cpu[1]) / steps}
        if self.database is not None:
            out.update(training_step_parts(self.database, start, time.time(), median, {}, {}))
        return out

    def close(self) -> None:
        try:
            self.service.close("success").result(timeout=60)  # its background work must not outlive the server
        finally:
            self.srv.stop()


def in_process(model: Path, steps: int, core: int | None) -> float:
    """The same step (forward_backward + optim_step) in this process (on ``core``): median ms."""
    import numpy as np

    from tests.e2e.helpers import sft_batch
    from tinsmith.models.loading import load_model
    from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec
    from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

    rt = TrainingRuntime(load_model(str(model)).model, max_lora_adapters=2, max_lora_rank=8)
    unit = rt.create_adapter(LoraSpec(rank=8))
    data = [Datum(np.array(d.model_input.to_ints()), {k: np.array(v.data) for k, v in d.loss_fn_inputs.items()})
            for d in sft_batch(0, 1, 16, 200)]
    request = [TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))]
    mask = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        walls = []
        for i in range(steps + 5):  # five warm steps
            t = time.perf_counter()
            rt.forward_backward(request)
            rt.optim_step(unit, AdamParams(learning_rate=1e-5))
            if i >= 5:
                walls.append(time.perf_counter() - t)
    finally:
        os.sched_setaffinity(0, mask)
        rt.delete_adapter(unit)
    return 1e3 * statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", default=".", help="comma-separated checkouts whose server runs, in turn")
    ap.add_argument("--databases", default="sqlite,postgres")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a server takes each round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    pg = postgres_if_asked(args.databases)
    pin = len(os.sched_getaffinity(0)) >= 2
    if pin:  # this process (the SDK's client) on one core, the servers on the other
        os.sched_setaffinity(0, {CLIENT_CORE})
    trainers: dict[tuple[str, str], SdkTrainer] = {}
    rounds: dict[tuple[str, str], list[dict]] = {}
    in_process_ms: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as d:
            model = make_tiny_model(Path(d) / "m", "qwen3", SHAPE, seed=0)
            try:
                for database in args.databases.split(","):
                    if database == "postgres" and pg is None:
                        continue
                    for checkout in args.checkouts.split(","):
                        url = pg.new_url() if database == "postgres" else None
                        trainers[(database, checkout)] = SdkTrainer(
                            model, Path(d) / f"data{len(trainers)}", Path(checkout).resolve(), url,
                            SERVER_CORE if pin else None)
                for t in trainers.values():
                    for _ in range(5):  # warm: first-call costs out of the figures
                        t.step()
                for r in range(args.rounds):  # the servers take turns, round by round: the drift hits all
                    for key, t in (list(trainers.items()) if r % 2 == 0 else list(trainers.items())[::-1]):
                        rounds.setdefault(key, []).append(t.timed(args.steps))
                    in_process_ms.append(in_process(model, args.steps, SERVER_CORE if pin else None))
            finally:
                for t in trainers.values():
                    t.close()
    finally:
        if pg is not None:
            pg.close()
    print(f"the same step in process: {', '.join(f'{ms:.2f}' for ms in in_process_ms)} ms (one per round)")
    results = []
    for (database, checkout), outs in rounds.items():
        summary = {"database": database, "checkout": checkout, "rounds": outs,
                   **{k: statistics.median(o[k] for o in outs) for k in outs[0] if isinstance(outs[0][k], float)}}
        results.append(summary)
        parts = (f"; server: forward_backward queue {summary['forward_backward_queue_ms']:.2f} + run "
                 f"{summary['forward_backward_run_ms']:.2f}, optim_step wait {summary['optim_step_wait_ms']:.2f} + run "
                 f"{summary['optim_step_run_ms']:.2f}, rest {summary['rest_ms']:.2f}" if "rest_ms" in summary else "")
        each = ", ".join(f"{o['step_ms']:.2f}" for o in outs)
        print(f"{database:>8} {checkout}: step {summary['step_ms']:.2f} ms (rounds: {each}); CPU a step: server "
              f"{summary['server_cpu_ms_per_step']:.1f}, client {summary['client_cpu_ms_per_step']:.1f} ms{parts}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "in_process_step_ms": in_process_ms,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
