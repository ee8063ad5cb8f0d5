"""Micro-benchmark: the host's time for one training step of 1, 4 and 16 tenants sharing it.

On a GPU several tenants' step is bound by the host (docs/performance.md): what the host does
per tenant and per layer (Python, launches) is what the device waits for. On a model of tiny
widths the CPU's kernels cost little, so the wall time of a step here is mostly that host work.
This times one forward/backward of every tenant together (8 rows of 16 tokens shared among them)
and then the tenants' optimizer steps (one by one, then together as the server takes steps that
arrive together), on Qwen3-1.7B's 28 layers at tiny widths, LoRA rank 32 on
every linear layer, with the multi-tenant paths a GPU takes (the grouped matmul and the fused
AdamW, forced here); medians of ``--steps`` steps after two warm ones, one thread. ``--widths``
16 shrinks the model's widths to 16 (rank 8): the CPU's kernels then cost almost nothing and
what is timed is nearly all host work.

    python bench/tenants_step_micro.py [--tenants 1,4,16] [--steps 10] [--dtype fp32|bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.train import batch, optimizer_steps  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.models import grouped_lora, moe  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.optim import families  # noqa: E402
from tinsmith.types import ForwardBackwardInput, LoraSpec  # noqa: E402
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest  # noqa: E402


def time_steps(rt: TrainingRuntime, tenants: int, steps: int, rows: int = 8, length: int = 16, rank: int = 32,
               together: bool = True) -> dict:
    """Median ms of the forward/backward, of all tenants' optimizer steps (taken together, as the
    server takes steps that arrive together, or one by one), and of both."""
    units = [rt.create_adapter(LoraSpec(rank=rank, seed=i)) for i in range(tenants)]
    per = max(1, rows // tenants)
    requests = [TrainRequest(u, ForwardBackwardInput(batch(rt.config.vocab_size, per, length, seed=i), "cross_entropy"))
                for i, u in enumerate(units)]
    fb, opt = [], []
    for i in range(steps + 2):  # two warm steps: layouts, stacks, optimizer state
        t0 = time.perf_counter()
        rt.forward_backward(requests)
        t1 = time.perf_counter()
        optimizer_steps(rt, units, together)
        if i >= 2:
            fb.append(t1 - t0)
            opt.append(time.perf_counter() - t1)
    for u in units:
        rt.delete_adapter(u)
    return {"forward_backward_ms": 1e3 * statistics.median(fb), "optimizer_steps_ms": 1e3 * statistics.median(opt),
            "step_ms": 1e3 * statistics.median(a + b for a, b in zip(fb, opt))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", default="1,4,16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--widths", type=int, choices=(16, 64), default=64, help="hidden size (rank 8 at 16, else 32)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    moe.GROUPED_MM = "grouped"  # the grouped matmul runs here as on a GPU
    grouped_lora.MULTI_LORA = "grouped"
    families.fused_adamw_fits = lambda params: True  # torch's fused AdamW, as on a GPU (it runs on CPUs too)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        w = args.widths
        shape = TinyShape(num_hidden_layers=args.layers, hidden_size=w, intermediate_size=2 * w, head_dim=16 if w > 16 else 8,
                          num_attention_heads=4 if w > 16 else 2, num_key_value_heads=2 if w > 16 else 1)
        make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        rt = TrainingRuntime(load_model(str(Path(d) / "m"), dtype=dtype).model, max_lora_adapters=16,
                             max_lora_rank=32)
        results = {}
        for n in (int(t) for t in args.tenants.split(",")):
            results[n] = {}
            for how in ("alone", "together"):  # the optimizer steps one by one, then together
                results[n][how] = r = time_steps(rt, n, args.steps, rank=32 if w > 16 else 8, together=how == "together")
                print(f"{n:>3} tenants, optimizer steps {how:>8}: step {r['step_ms']:7.1f} ms (forward/backward "
                      f"{r['forward_backward_ms']:6.1f}, optimizer steps {r['optimizer_steps_ms']:6.1f}: "
                      f"{r['optimizer_steps_ms'] / n:5.1f} a tenant)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "layers": args.layers, "dtype": args.dtype,
                                               "widths": args.widths,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
