"""Micro-benchmark: the sampler's host work between decode steps, the step itself left out.

On a GPU a decode step replayed from a CUDA graph costs the host one launch, and everything else
the sampler does per burst (stop checks, recording tokens, the K/V budget's accounting, page
reservations, admission) runs while the device waits for the next burst. This times that work
alone: the static step (what the graphs record) runs eagerly here and its time is subtracted.
The sampler is the server's (paged K/V, steps of ``--burst`` per read-back, its cache kept
between runs) under a K/V budget as a GPU server has one; the timed run is the second of two
equal runs, so the page pool has grown already.

    python bench/decode_host_micro.py [--model DIR] [--rows 64,256] [--tokens 128] [--repeats 3] [--adapters 0,8]

Prints, per row count, milliseconds of host work per decode step (the median of the repeats);
``--adapters``: for each count, rows take that many LoRA adapters (rank 32, every projection) in
turn, 0 being the base model, so the adapters' own host work per step shows beside the base's.
Without ``--model`` a ~4.2M-parameter Qwen3 is made on the spot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_micro import model_dir_or_tiny  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.sampling.decode_graphs import DecodeGraphs  # noqa: E402
from tinsmith.sampling.sampler import Sampler, SampleTask  # noqa: E402
from tinsmith.types import LoraSpec, SampleInput, SamplingParams  # noqa: E402
from tinsmith.worker.runtime import TrainingRuntime  # noqa: E402

KV_BUDGET_BYTES = 20 * 2**30  # far above what the rows take: the budget's checks run, never bind


def host_ms_per_step(model, rows: int, tokens: int, burst: int, seed: int, slots: list[int | None] = (None,)) -> float:
    """Host milliseconds per decode step outside the static step, over ``rows`` rows of ``tokens``,
    row ``i`` sampling with adapter slot ``slots[i % len(slots)]``."""
    sampler = Sampler(model, lambda toks: "", max_rows=rows, decode_burst=burst, kv_layout="paged",
                      kv_cache_bytes=KV_BUDGET_BYTES, keep_cache_when_idle=True)
    graphs = sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    in_step = [0.0]
    step = graphs._step

    def timed_step(*args) -> None:
        t = time.perf_counter()
        step(*args)
        in_step[0] += time.perf_counter() - t

    graphs._step = timed_step
    rng = np.random.default_rng(seed)

    def run() -> tuple[float, int]:
        for i in range(rows):
            params = SamplingParams(max_tokens=tokens, temperature=1.0, stop=[], seed=i)
            sampler.add(SampleTask(i, slots[i % len(slots)], SampleInput(rng.integers(4, 200, 32), 1, params)))
        sampler.step(budget_s=0.0)  # admission and prefill, outside the timing
        before, in_step[0] = sampler.stats["decode_steps"], 0.0
        t = time.perf_counter()
        while sampler.has_work():
            sampler.step(budget_s=0.05)
        return time.perf_counter() - t - in_step[0], sampler.stats["decode_steps"] - before

    with torch.inference_mode():
        run()  # the page pool grows here
        host_s, steps = run()
    return 1e3 * host_s / max(1, steps)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: a tiny Qwen3 made here)")
    p.add_argument("--rows", default="64,256")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--burst", type=int, default=4, help="decode steps per read-back (the GPU default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--adapters", default="0", help="adapter counts the rows take in turn (0: the base model)")
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_dir, tmp = model_dir_or_tiny(a.model)
    try:
        model = load_model(model_dir, device=torch.device("cpu")).model
        counts = [int(n) for n in a.adapters.split(",")]
        units: list[int] = []
        if max(counts) > 0:
            rt = TrainingRuntime(model, max_lora_adapters=max(counts), max_lora_rank=32, max_training_runs=max(counts))
            units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(max(counts))]
        out: dict = {"tokens": a.tokens, "burst": a.burst}
        for rows in (int(r) for r in a.rows.split(",")):
            for n in counts:
                slots = units[:n] if n else [None]
                runs = [host_ms_per_step(model, rows, a.tokens, a.burst, seed, slots) for seed in range(a.repeats)]
                key = f"rows_{rows}" + (f"_adapters_{n}" if n else "")
                out[key] = {"host_ms_per_step": statistics.median(runs), "runs": runs}
    finally:
        torch.set_num_threads(threads)  # a caller's process (a test run) keeps its threads
    print(json.dumps(out, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
