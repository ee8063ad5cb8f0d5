"""Micro-benchmark: LoRA forward_backward tokens/s of the runtime, beside the FLOP bound.

The bound is what the machine's measured fp32 (or bf16 on GPU) matmul rate allows for
``4 x params x tokens`` FLOPs per LoRA forward+backward (no weight gradients for the frozen
base). ``fraction`` = measured tokens/s / bound tokens/s.

    python bench/fwdbwd_micro.py [--model DIR] [--shapes 8x128,32x512] [--json out.json]
    python bench/fwdbwd_micro.py --mixed 32,64,1024   # padded vs packed, uneven lengths

``--mixed N,LO,HI`` runs one batch of N sequences with lengths uniform in LO..HI in both
training layouts (right-padded rows and packed documents), alternating step by step in one
process so that both see the same machine load.

Without ``--model`` a ~4.2M-parameter Qwen3 is made on the spot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.tiny_model import make_tiny_model  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec  # noqa: E402
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest  # noqa: E402


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 2.0) -> float:
    """Sustained dense matmul FLOP/s on square n x n operands (best of several runs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - t))
    return best


def bench_shape(rt: TrainingRuntime, unit: int, batch: int, length: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    V = rt.config.vocab_size

    def datum() -> Datum:
        t = rng.integers(0, V, length + 1)
        return Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)})

    data = [datum() for _ in range(batch)]
    req = [TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))]
    t0 = time.perf_counter()
    rt.forward_backward(req)
    rt.optim_step(unit, AdamParams())
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        rt.forward_backward(req)
        rt.optim_step(unit, AdamParams())
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"shape": f"{batch}x{length}", "tokens": batch * length, "median_step_s": med,
            "tokens_per_s": batch * length / med, "first_step_s": first}


def bench_mixed(rt: TrainingRuntime, unit: int, n: int, lo: int, hi: int, steps: int) -> list[dict]:
    """Padded and packed micro-batches over one uneven batch, steps interleaved (same load for both)."""
    rng = np.random.default_rng(0)
    V = rt.config.vocab_size
    lengths = rng.integers(lo, hi + 1, n)
    data = []
    for length in lengths:
        t = rng.integers(0, V, length + 1)
        data.append(Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)}))
    req = [TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))]
    layouts = {"padded": False, "packed": True}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    for step in range(steps + 1):
        order = list(layouts.items())
        for name, packed in order if step % 2 else order[::-1]:  # each layout first every other step
            rt.packing = packed and rt.model.supports_packing
            t = time.perf_counter()
            rt.forward_backward(req)
            rt.optim_step(unit, AdamParams())
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            if step:  # the first step of each warms up
                times[name].append(time.perf_counter() - t)
    tokens = int(lengths.sum())
    return [{"shape": f"{name} {n}x{lo}..{hi}", "tokens": tokens, "median_step_s": statistics.median(ts),
             "tokens_per_s": tokens / statistics.median(ts), "first_step_s": float("nan")}
            for name, ts in times.items()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir or id (default: a tiny 4.2M Qwen3 made on the spot)")
    p.add_argument("--shapes", default="1x128,8x128,8x512,32x512")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--mixed", help="N,LO,HI: N sequences of lengths uniform in LO..HI, padded vs packed "
                                   "(instead of --shapes)")
    p.add_argument("--micro-batch-tokens", type=int, help="training micro-batch budget in tokens (default: the "
                                                          "runtime's; the server's automatic one on CPU is 2048)")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)

    model_dir = a.model or make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-qwen3", "qwen3")
    device = torch.device(a.device)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, gradient_checkpointing=a.gradient_checkpointing, max_lora_rank=max(128, a.rank),
                         **({} if a.micro_batch_tokens is None else {"micro_batch_tokens": a.micro_batch_tokens}))
    unit = rt.create_adapter(LoraSpec(rank=a.rank, seed=0))
    params = lm.config.num_params
    dtype = next(lm.model.parameters()).dtype
    rate = matmul_rate(device, dtype)
    if a.mixed:
        n, lo, hi = (int(x) for x in a.mixed.split(","))
        measured = bench_mixed(rt, unit, n, lo, hi, a.steps)
    else:
        measured = [bench_shape(rt, unit, *(int(x) for x in shape.split("x")), a.steps)
                    for shape in a.shapes.split(",")]
    rows = []
    for r in measured:
        r["bound_tokens_per_s"] = rate / (4 * params)
        r["fraction_of_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
        rows.append(r)
    out = {
        "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
        "params": params, "lora_rank": a.rank, "matmul_flops_per_s": rate, "results": rows,
    }
    print(f"model params {params/1e6:.2f}M  dtype {dtype}  device {device}  threads {torch.get_num_threads()}  "
          f"matmul {rate/1e9:.1f} GFLOP/s  LoRA rank {a.rank}")
    print(f"{'shape':>22} {'tokens/s':>10} {'bound tok/s':>12} {'of bound':>9} {'step ms':>8} {'first ms':>9}")
    for r in rows:
        print(f"{r['shape']:>22} {r['tokens_per_s']:>10.0f} {r['bound_tokens_per_s']:>12.0f} "
              f"{100*r['fraction_of_bound']:>8.1f}% {1000*r['median_step_s']:>8.1f} {1000*r['first_step_s']:>9.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
