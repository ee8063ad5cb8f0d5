"""Micro-benchmark: what one call of a tensor-parallel group costs, local followers vs Ray actors.

Every call the worker makes under ``--tensor-parallel-size N`` (a forward_backward chunk, a
sampling slice) is rung to the followers (a pipe byte for local processes, a Ray actor call with
``--ray-address``), broadcast, run, and its outcome exchanged. Measured here on a tiny model
made on the spot, both groups of two CPU ranks (gloo) in one process, one after the other and
then the local one again (a noisy machine shows in the gap between its two readings):

* ``empty``: a call that does no work (``sample`` with no task): the fixed cost per call.
* ``forward_backward``: one LoRA forward/backward of ``--tokens`` tokens on the tiny model.

Reported: median milliseconds per call. Needs Ray (``pip install 'tinsmith[ray]'``); a local
Ray cluster of two CPUs is started and stopped here.

    python bench/tp_call_micro.py [--calls 200] [--tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.parallel.worker import LocalTPGroup, rank_worker_factory  # noqa: E402
from tinsmith.types import Datum, ForwardBackwardInput, LoraSpec  # noqa: E402
from tinsmith.worker.runtime import TrainRequest  # noqa: E402

SHAPE = TinyShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _median_ms(fn, calls: int) -> float:
    for _ in range(min(20, calls)):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(group, calls: int, tokens: int) -> dict[str, float]:
    unit = group.call("train", "create_adapter", LoraSpec(rank=4, seed=0))
    ids = np.random.default_rng(0).integers(0, SHAPE.vocab_size, tokens + 1).astype(np.int64)
    datum = Datum(tokens=ids[:-1], loss_inputs={"target_tokens": ids[1:], "weights": np.ones(tokens, np.float32)})
    request = TrainRequest(unit, ForwardBackwardInput([datum], "cross_entropy"))
    return {"empty": _median_ms(lambda: group.call("sample", []), calls),
            "forward_backward": _median_ms(lambda: group.call("train", "forward_backward", [request]), calls // 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "qwen3", "qwen3", SHAPE, seed=1))
        make_target = rank_worker_factory(model_dir)
        results = {}
        group = LocalTPGroup(model_dir, 2)
        results["local"] = measure(group, args.calls, args.tokens)
        group.close()
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        from tinsmith.parallel.ray_group import RayTPGroup

        group = RayTPGroup(2, "auto", make_target)
        results["ray"] = measure(group, args.calls, args.tokens)
        group.close()
        ray.shutdown()
        group = LocalTPGroup(model_dir, 2)
        results["local_again"] = measure(group, args.calls, args.tokens)
        group.close()
    print(f"{'group':12} {'empty call ms':>14} {'forward_backward ms':>20}")
    for name, r in results.items():
        print(f"{name:12} {r['empty']:14.3f} {r['forward_backward']:20.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(), "calls": args.calls,
                                         "tokens": args.tokens, "median_ms": results}, indent=2))


if __name__ == "__main__":
    main()
