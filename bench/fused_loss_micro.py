"""Micro-benchmark: target logprobs through the unembedding, plain vs chunked (fused) path.

Plain: ``(h @ W^T).float()`` over the whole vocabulary, then log-softmax and a gather (what the
runtime did before). Chunked: :func:`tinsmith.models.chunked_logprobs.chunked_target_logprobs`.
Each case runs forward + backward (gradient of the hidden states, as LoRA training needs; add
``--train-weight`` for a full fine-tune's weight gradient too) and reports the median time and
the peak tensor memory of one step above what existed before it.

    python bench/fused_loss_micro.py [--device cpu|cuda] [--shapes 2048x256x32000] [--json out.json]

Shapes are ``tokens x hidden x vocab``. Defaults: on CPU 2048 x 256 x 32000 fp32; on CUDA the
Qwen3-1.7B head (8192 x 2048 x 151936) in bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.memory import PeakTensorMemory  # noqa: E402
from tinsmith.models.chunked_logprobs import DEFAULT_CHUNK_BYTES, chunked_target_logprobs, rows_per_chunk  # noqa: E402


def plain(h, w, rows, cols, chunk_bytes):
    logits = (h @ w.t()).float()
    return logits[rows, cols] - torch.logsumexp(logits, -1)[rows]


def chunked(h, w, rows, cols, chunk_bytes):
    return chunked_target_logprobs(h, w, rows, cols, chunk_rows=rows_per_chunk(w.shape[0], chunk_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(fn, h, w, rows, cols, g, chunk_bytes) -> None:
    h.grad = w.grad = None
    (fn(h, w, rows, cols, chunk_bytes) * g).sum().backward()


def peak_bytes(fn, args, device: torch.device) -> int:
    """Peak memory of one step above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _step(fn, *args)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - base
    with PeakTensorMemory() as mem:
        _step(fn, *args)
    return mem.peak_bytes


def seconds(fn, args, device: torch.device, reps: int) -> float:
    _step(fn, *args)  # warm-up
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        _step(fn, *args)
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_case(n: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, reps: int,
             train_weight: bool, chunk_bytes: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hidden, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5).to(dtype).requires_grad_(train_weight)
    rows = torch.arange(n, device=device)
    cols = torch.randint(0, vocab, (n,), generator=g, device=device)
    grad = torch.randn(n, generator=g, device=device)
    args = (h, w, rows, cols, grad, chunk_bytes)
    out = {"tokens": n, "hidden": hidden, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
           "train_weight": train_weight, "full_logits_mib": n * vocab * 4 / 2**20,
           "chunk_rows": rows_per_chunk(vocab, chunk_bytes)}
    for name, fn in (("plain", plain), ("chunked", chunked)):
        out[f"{name}_ms"] = 1e3 * seconds(fn, args, device, reps)
        out[f"{name}_peak_mib"] = peak_bytes(fn, args, device) / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated tokens x hidden x vocab")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-weight", action="store_true", help="also the unembedding weight's gradient")
    ap.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    shapes = a.shapes or ("8192x2048x151936" if cuda else "2048x256x32000")
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else platform.processor()
           or platform.machine(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    results = []
    for shape in shapes.split(","):
        n, hidden, vocab = (int(x) for x in shape.split("x"))
        r = run_case(n, hidden, vocab, dtype, device, a.reps, a.train_weight, a.chunk_mib << 20)
        results.append(r)
        print(f"{n}x{hidden}x{vocab} {r['dtype']}: plain {r['plain_ms']:.1f} ms, {r['plain_peak_mib']:.0f} MiB | "
              f"chunked {r['chunked_ms']:.1f} ms, {r['chunked_peak_mib']:.0f} MiB "
              f"(full logits {r['full_logits_mib']:.0f} MiB, {r['chunk_rows']} rows a chunk)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"env": env, "results": results}, indent=2))


if __name__ == "__main__":
    main()
