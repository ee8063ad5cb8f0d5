"""Micro-benchmark: a key sampling beside a key training, through the SDK, on the CPU.

Runs ``bench/gpu``'s ``beside_training`` item (a real server on this machine; one key trains
LoRA rank 32 on 8 x 1024 tokens a step for 4 steps while another samples 8 prompts x 8 samples x
256 tokens; each alone, then both at once) on the default tiny Qwen3, ``--runs`` times, and
prints what each keeps of its speed alone. The engine shares the device between the two kinds
by time per key (docs/sampling.md, "Sharing the device with training"): both should keep about
half or more, neither far less than the other.

    python bench/beside_training_micro.py [--runs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.sample import beside_training  # noqa: E402
from tinsmith.devtools.tiny_model import make_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "m", "qwen3", seed=0)
        for run in range(args.runs):
            r = beside_training(model, torch.device("cpu"), False, Path(d) / f"run{run}")
            results.append(r)
            alone, together = r["alone"], r["together"]
            print(f"run {run}: training {alone['train_tokens_per_s']:.0f} -> {together['train_tokens_per_s']:.0f} tok/s "
                  f"(kept {r['train_kept']:.3f}), sampling {alone['sample_tokens_per_s']:.0f} -> "
                  f"{together['sample_tokens_per_s']:.0f} tok/s (kept {r['sample_kept']:.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
