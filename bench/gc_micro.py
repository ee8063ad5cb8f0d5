"""Micro-benchmark: what Python's cyclic garbage collector costs a serving process, with CPython's
defaults and with the server's tuning (``tinsmith.gc_tuning``: the start-up heap frozen, the
youngest generation collected every 10,000 allocations).

A collection holds the interpreter lock: no thread runs meanwhile, and on a GPU the device idles
once its queue drains. Two parts:

- ``train`` (default): training steps of 1, 4 and 16 tenants in this process (the multi-tenant
  paths a GPU takes, tiny widths, 28 layers: bench/tenants_step_micro.py's step), with the
  defaults and with the tuning, alternated ``--rounds`` times in one process. Per step: the
  collector's pause, the longest pause, the collections, the step's wall time.
- ``requests``: a real server of this checkout (``tinsmith serve``, which tunes itself) on a
  micro Qwen3, sent ``--requests`` separate sample requests of one token at once through the
  SDK, four times; the server process's CPU time per request and the collector's pauses in it
  (timed by a ``gc.callbacks`` hook the bench loads into the server, so a server of any commit is
  timed alike: run the bench at an older commit for the figure without the tuning).

    python bench/gc_micro.py [--part train|requests] [--rounds 2] [--steps 10] [--requests 512]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_times import cpu_seconds  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402


class Pauses:
    """Every collection's pause while active (its own callback: the longest pause too)."""

    def __init__(self) -> None:
        self.count, self.seconds, self.longest, self._t = [0, 0, 0], 0.0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        dt = time.perf_counter() - self._t
        self.count[info["generation"]] += 1
        self.seconds += dt
        self.longest = max(self.longest, dt)


def train_part(rounds: int, steps: int, tenants: list[int]) -> list[dict]:
    from bench.tenants_step_micro import time_steps
    from tinsmith.gc_tuning import tuned_for_serving
    from tinsmith.models import grouped_lora, moe
    from tinsmith.models.loading import load_model
    from tinsmith.optim import families
    from tinsmith.worker.runtime import TrainingRuntime

    torch.set_num_threads(1)
    moe.GROUPED_MM = "grouped"  # the multi-tenant paths a GPU takes
    grouped_lora.MULTI_LORA = "grouped"
    families.fused_adamw_fits = lambda params: True
    out = []
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(num_hidden_layers=28, hidden_size=16, intermediate_size=32, head_dim=8,
                          num_attention_heads=2, num_key_value_heads=1)
        make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        rt = TrainingRuntime(load_model(str(Path(d) / "m"), dtype=torch.bfloat16).model, max_lora_adapters=16,
                             max_lora_rank=32)
        for r in range(rounds):
            for mode in ("defaults", "tuned"):
                for n in tenants:
                    pauses = Pauses()
                    with tuned_for_serving() if mode == "tuned" else contextlib.nullcontext():
                        gc.callbacks.append(pauses)
                        try:
                            t = time_steps(rt, n, steps, rank=8, together=True)
                        finally:
                            gc.callbacks.remove(pauses)
                    row = {"round": r, "mode": mode, "tenants": n, "step_ms": t["step_ms"],
                           "gc_ms_per_step": 1e3 * pauses.seconds / (steps + 2), "longest_pause_ms": 1e3 * pauses.longest,
                           "collections": pauses.count}
                    out.append(row)
                    print(f"round {r} {mode:>8} {n:>2} tenants: step {row['step_ms']:6.1f} ms, collector "
                          f"{row['gc_ms_per_step']:5.2f} ms a step, longest pause {row['longest_pause_ms']:6.1f} ms, "
                          f"collections {pauses.count} (generations 0/1/2)",
                          flush=True)
    return out


# Loaded into the server through PYTHONPATH (it imports nothing of tinsmith, so it times a server of
# any commit the same way): every collection's pause, summed per generation, written to a file.
_HOOK = """
import gc, json, os, threading, time
_out, _sums, _t = os.environ["GC_MICRO_OUT"], [[0, 0.0], [0, 0.0], [0, 0.0]], [0.0]
def _on(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        s = _sums[info["generation"]]; s[0] += 1; s[1] += time.perf_counter() - _t[0]
gc.callbacks.append(_on)
def _write():
    while True:
        time.sleep(0.2)
        with open(_out + ".tmp", "w") as f:
            json.dump(_sums, f)
        os.replace(_out + ".tmp", _out)
threading.Thread(target=_write, daemon=True).start()
"""


def _pauses(path: Path) -> tuple[list[int], float]:
    """(collections per generation, seconds paused) the server's hook last wrote."""
    time.sleep(0.5)  # the hook writes every 0.2 s
    sums = json.loads(path.read_text())
    return [c for c, _ in sums], sum(s for _, s in sums)


def requests_part(n: int) -> list[dict]:
    import tinker
    from tinker import types

    from bench.gpu.sample import sdk_prompts
    from tests.e2e.server import ServerProcess

    out = []
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=2, num_key_value_heads=1)
        model = make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        hook, readings = Path(d) / "hook", Path(d) / "pauses.json"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        repo = str(Path(__file__).resolve().parents[1])
        srv = ServerProcess(model, Path(d) / "data", extra_args=["--device", "cpu"], log_dir=Path(d),
                            env={"PYTHONPATH": os.pathsep.join([str(hook), repo]), "GC_MICRO_OUT": str(readings)})
        srv.start(timeout=600)
        try:
            sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench-gc")
            s = sc.create_sampling_client(base_model=str(model)).result(timeout=600)
            params = types.SamplingParams(max_tokens=1, temperature=1.0, stop=[])
            for r in range(4):
                prompts = sdk_prompts(r, 8, 1, False)[0]
                (count0, paused0), cpu, t = _pauses(readings), cpu_seconds(srv.proc.pid), time.perf_counter()
                for f in [s.sample(prompts[i % 8], 1, params) for i in range(n)]:
                    f.result(timeout=600)
                wall, cpu = time.perf_counter() - t, cpu_seconds(srv.proc.pid) - cpu
                count1, paused1 = _pauses(readings)
                row = {"round": r, "requests": n, "wall_s": wall, "server_cpu_ms_per_request": 1e3 * cpu / n,
                       "gc_ms_per_request": 1e3 * (paused1 - paused0) / n,
                       "collections": [b - a for a, b in zip(count0, count1)]}
                out.append(row)
                print(f"round {r}: {n} requests in {wall:.2f} s, server CPU {row['server_cpu_ms_per_request']:.2f} ms "
                      f"a request, collector {row['gc_ms_per_request']:.2f} ms a request (collections "
                      f"{row['collections']}, generations 0/1/2)", flush=True)
        finally:
            srv.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("train", "requests"), default="train")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tenants", default="1,4,16")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.part == "train":
        results = train_part(args.rounds, args.steps, [int(t) for t in args.tenants.split(",")])
    else:
        results = requests_part(args.requests)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "part": args.part, "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
