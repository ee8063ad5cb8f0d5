"""Micro-benchmark: GRPO's separate sample requests against ``num_samples``, through the SDK, on a
model small enough that a round decodes in about the time a GPU takes for the 1.7B shape.

On the default tiny model a CPU decodes so slowly that 128 requests' arrival is lost in the
decode; on this micro Qwen3 (hidden 32, 2 layers) a round of 8 prompts x 16 samples x 256 tokens
takes about a second, so the request path's share shows as it does on a GPU
(docs/performance.md). Runs ``bench/gpu``'s ``through_sdk`` item (a real server on this machine,
two rounds of each kind, the second timed) ``--runs`` times and prints each run's ratio, the
requests' arrival and completion times the server's store recorded, and its counters.

    python bench/grpo_micro.py [--runs 3] [--hidden 32] [--layers 2] [--transport httpx|pyqwest] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.sample import through_sdk  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--transport", choices=("httpx", "pyqwest"), default="httpx",
                    help="the SDK's HTTP transport, as the server hands it (--client-http-transport)")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                          head_dim=16, num_attention_heads=max(1, args.hidden // 16), num_key_value_heads=1)
        model = make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        for run in range(args.runs):
            grpo = through_sdk(model, torch.device("cpu"), False, Path(d) / f"run{run}", args.transport)["grpo"]
            results.append(grpo)
            for kind in ("separate", "num_samples"):
                t, c, u = grpo[f"{kind}_timeline"], grpo[f"{kind}_server"], grpo[f"{kind}_cpu"]
                print(f"run {run} {kind:>11}: sent {t.get('first_send_s', 0):.3f}..{t.get('last_send_s', 0):.3f} s, "
                      f"arrivals {t.get('first_arrival_s', 0):.3f}..{t.get('last_arrival_s', 0):.3f} s, "
                      f"last start {t.get('last_start_s', 0):.3f} s, "
                      f"last completion {t.get('last_completion_s', 0):.3f} s, prefills {c.get('prefills', 0):.0f}, "
                      f"decode steps {c.get('decode_steps', 0):.0f}, asample HTTP {1e3 * c.get('asample_http_mean_s', 0):.1f} ms, "
                      f"CPU a request: client {u['client_ms_per_request']:.2f} ms, server {u['server_ms_per_request']:.2f} "
                      f"(its loop {u['server_loop_ms_per_request']:.2f})",
                      flush=True)
            print(f"run {run}: separate / num_samples {grpo['separate_vs_num_samples']:.3f} "
                  f"(first round {grpo['first_round_separate_vs_num_samples']:.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "hidden": args.hidden,
                                               "layers": args.layers, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
