"""Micro-benchmark: the sampler's decode step in-process, beside its GEMM-only bound.

A decode step of ``n`` rows multiplies every projection once per row, so its matrix products
cost ``2 x n x (non-embedding params)`` FLOPs. The bound printed here times exactly those
products on this machine at the same shapes (one row block of ``n`` through each packed weight,
weights streamed as in a real step) and turns that into tokens/s. ``fraction`` = measured
tokens/s / that bound: what the ~300 other eager ops of a step (norms, rotary, attention,
sampling, bookkeeping) cost on top of the GEMMs.

    python bench/decode_micro.py [--model DIR] [--rows 16,64] [--tokens 64] [--repeats 5] [--static-step]

``--static-step`` adds the static decode step (the fixed-shape step CUDA graphs record, run
eagerly here) beside the eager one, runs of the two interleaved in one process.

Without ``--model`` a ~4.2M-parameter Qwen3 is made on the spot.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.tiny_model import make_tiny_model  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.sampling.decode_graphs import DecodeGraphs  # noqa: E402
from tinsmith.sampling.sampler import Sampler, SampleTask  # noqa: E402
from tinsmith.types import SampleInput, SamplingParams  # noqa: E402


def model_dir_or_tiny(model_dir: str | None) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """``model_dir``, or a tiny Qwen3 made in a temporary folder (which lives as long as the
    returned handle)."""
    if model_dir is not None:
        return model_dir, None
    tmp = tempfile.TemporaryDirectory()
    return str(make_tiny_model(Path(tmp.name) / "model")), tmp


def add_random_prompts(sampler: Sampler, rows: int, prompt_len: int, params: SamplingParams,
                       rng: np.random.Generator, slots: list[int | None] | tuple = (None,)) -> None:
    """Queue ``rows`` single-sample requests of random prompts, row ``i`` on ``slots[i % len(slots)]``."""
    for i in range(rows):
        sampler.add(SampleTask(i, slots[i % len(slots)],
                               SampleInput(prompt=rng.integers(4, sampler.cfg.vocab_size, prompt_len), num_samples=1,
                                           params=params)))


def decode_rate(sampler: Sampler, rows: int, tokens: int, prompt_len: int, seed: int) -> float:
    """Sampled tokens/s of the decode steps alone (prefill excluded) for ``rows`` sequences."""
    add_random_prompts(sampler, rows, prompt_len, SamplingParams(max_tokens=tokens, temperature=1.0, stop=[]),
                       np.random.default_rng(seed))
    done: list = []
    with torch.inference_mode():
        sampler._admit(done)
        t = time.perf_counter()
        steps = 0
        while sampler.rows:
            sampler._decode_step(done)
            steps += 1
        wall = time.perf_counter() - t
    return rows * steps / wall


def gemm_bound(model, rows: int, repeats: int = 20) -> float:
    """Tokens/s if a step cost only its matrix products (measured at the step's shapes)."""
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.packed_qkv.weight, layer.self_attn.o_proj.weight.t(),
                    layer.mlp.packed_gate_up.weight, layer.mlp.down_proj.weight.t()]
    weights.append(model.lm_head.weight.t())
    xs = [torch.randn(rows, w.shape[0], dtype=w.dtype) for w in weights]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for x, w in zip(xs, weights):
                x @ w
            best = min(best, time.perf_counter() - t)
    return rows / best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir or id (default: a tiny 4.2M Qwen3 made on the spot)")
    p.add_argument("--rows", default="16,64", help="comma-separated decode batch sizes")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch size (the best is kept)")
    p.add_argument("--static-step", action="store_true",
                   help="also time the static decode step (padded rows, whole-capacity K/V), interleaved")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    model_dir, tmp = model_dir_or_tiny(a.model)
    model = load_model(model_dir).model
    sampler = Sampler(model, lambda toks: "")
    out = {"threads": torch.get_num_threads(), "rows": {}}
    print(f"{'rows':>6} {'tokens/s':>10} {'GEMM bound':>11} {'fraction':>9}")
    for rows in (int(r) for r in a.rows.split(",")):
        decode_rate(sampler, rows, 4, a.prompt_length, seed=0)  # warm-up
        rate = max(decode_rate(sampler, rows, a.tokens, a.prompt_length, seed=i) for i in range(a.repeats))
        bound = gemm_bound(model, rows)
        out["rows"][rows] = {"tokens_per_s": rate, "gemm_bound_tokens_per_s": bound, "fraction": rate / bound}
        print(f"{rows:>6} {rate:>10.0f} {bound:>11.0f} {rate / bound:>8.1%}")
    if a.static_step:
        out["static_step"] = static_vs_eager(model, [int(r) for r in a.rows.split(",")], a)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


def static_vs_eager(model, rows_list: list[int], a) -> dict:
    """Best tokens/s of the eager and the static decode step per batch size, runs interleaved so
    that load on a shared machine falls on both alike."""
    print(f"{'rows':>6} {'eager':>10} {'static':>10} {'static/eager':>13}")
    out = {}
    for rows in rows_list:
        best = {False: 0.0, True: 0.0}
        for i in range(a.repeats):
            for static in (False, True):
                sampler = Sampler(model, lambda toks: "", max_rows=rows)
                if static:
                    sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
                best[static] = max(best[static], decode_rate(sampler, rows, a.tokens, a.prompt_length, seed=i))
        out[rows] = {"eager_tokens_per_s": best[False], "static_tokens_per_s": best[True],
                     "static_vs_eager": best[True] / best[False]}
        print(f"{rows:>6} {best[False]:>10.0f} {best[True]:>10.0f} {best[True] / best[False]:>12.2f}x")
    return out


if __name__ == "__main__":
    main()
