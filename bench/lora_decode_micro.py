"""Micro-benchmark: decode steps of a batch mixing 1, 8 or 64 LoRA adapters, beside the base model.

Every row of a ``--rows`` batch decodes ``--tokens`` tokens; rows take the adapters in turn.
Two ways of applying the adapters are timed side by side in one process:

- ``grouped``: one small matmul pair per adapter in the batch, per projection (RowGroups);
- ``bank``: one gathered shrink/expand per projection over stacked adapter banks (RowSlots;
  the Triton kernels on CUDA when triton is installed, the torch path otherwise).

``vs base`` = base-model step time / step time with adapters (1.0: adapters cost nothing).

    python bench/lora_decode_micro.py [--model DIR] [--device cuda] [--rows 64] [--adapters 1,8,64]

Without ``--model`` a ~4.2M-parameter Qwen3 is made on the spot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_micro import add_random_prompts, model_dir_or_tiny  # noqa: E402
from tinsmith.kernels import lora_gather  # noqa: E402
from tinsmith.models import lora as lora_mod  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.sampling.sampler import Sampler  # noqa: E402
from tinsmith.types import LoraSpec, SamplingParams  # noqa: E402
from tinsmith.worker.trainables import install_lora_weights  # noqa: E402

FIRST_SLOT = 1_000_000


def install_adapters(model, count: int, rank: int) -> list[int]:
    """``count`` frozen random adapters (every projection and the LM head), as sampler snapshots."""
    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    g = torch.Generator().manual_seed(0)
    slots = []
    for i in range(count):
        tensors = {}
        for name, layer in model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed):
            a_shape, b_shape = layer.lora_shapes(rank)
            tensors[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=g) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=g) * 0.02
        install_lora_weights(model, FIRST_SLOT + i, spec, tensors)
        slots.append(FIRST_SLOT + i)
    return slots


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(sampler: Sampler, slots: list[int | None], rows: int, tokens: int, prompt_len: int) -> float:
    """Mean wall seconds of one decode step (prefill excluded) of ``rows`` rows."""
    add_random_prompts(sampler, rows, prompt_len, SamplingParams(max_tokens=tokens + 1, temperature=1.0, stop=[]),
                       np.random.default_rng(0), slots)
    done: list = []
    with torch.inference_mode():
        sampler._admit(done)
        sampler._decode_step(done)  # builds the batch (and refreshes the banks) outside the timing
        sync(sampler.device)
        t = time.perf_counter()
        for _ in range(tokens - 1):
            sampler._decode_step(done)
        sync(sampler.device)
        wall = time.perf_counter() - t
        while sampler.rows:
            sampler._decode_step(done)
    return wall / (tokens - 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir (default: a tiny 4.2M Qwen3 made on the spot)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--adapters", default="1,8,64", help="comma-separated adapter counts")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8, help="decode steps timed per run")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (the best is kept)")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    model_dir, tmp = model_dir_or_tiny(a.model)
    device = torch.device(a.device)
    model = load_model(model_dir, device=device).model
    counts = [int(c) for c in a.adapters.split(",")]
    slots = install_adapters(model, max(counts), a.rank)
    sampler = Sampler(model, lambda toks: "", max_rows=a.rows)
    kernels = "triton" if lora_gather.triton_usable(torch.empty(0, device=device)) else "torch"

    cases: list[tuple[str, int, str]] = [("base", 0, "")] + [(f"{n}/{m}", n, m) for n in counts for m in ("grouped", "bank")]
    best = {name: float("inf") for name, _, _ in cases}
    saved = lora_mod.DECODE_LORA
    try:
        for rep in range(a.repeats + 1):  # cases interleaved, so that load from elsewhere hits them alike
            for name, n, mode in cases:
                lora_mod.DECODE_LORA = mode or saved
                s = step_seconds(sampler, slots[:n] if n else [None], a.rows, 3 if rep == 0 else a.tokens,
                                 a.prompt_length)
                if rep:  # the first round warms up (and compiles the Triton kernels)
                    best[name] = min(best[name], s)
    finally:
        lora_mod.DECODE_LORA = saved
    base = best["base"]
    out: dict = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "rows": a.rows, "rank": a.rank, "bank_kernels": kernels, "base_step_ms": base * 1e3, "adapters": {}}
    print(f"device {device}, {a.rows} rows, rank {a.rank}, bank kernels: {kernels}; base step {base * 1e3:.2f} ms")
    print("(one adapter for every row is one plain segment on both paths)")
    print(f"{'adapters':>8} {'grouped ms':>11} {'vs base':>8} {'bank ms':>9} {'vs base':>8}")
    for n in counts:
        g, b = best[f"{n}/grouped"], best[f"{n}/bank"]
        out["adapters"][n] = {"grouped": {"step_ms": g * 1e3, "vs_base": base / g},
                              "bank": {"step_ms": b * 1e3, "vs_base": base / b}}
        print(f"{n:>8} {g * 1e3:>11.2f} {base / g:>8.2f} {b * 1e3:>9.2f} {base / b:>8.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
