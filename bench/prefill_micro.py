"""Micro-benchmark: how long running rows stall while a long prompt is prefilled, whole vs chunked.

``--rows`` single-sample requests decode; once they are all decoding, one request with a
``--prompt-length`` prompt arrives. Every decode step's end is timed; reported per
configuration (whole prefill, ``--sampler-prefill-chunk-tokens`` of ``--chunks``): the longest
gap between two decode steps of the running rows while the long prompt is prefilled (the stall
they see), the median gap outside it (a plain decode step), the long prompt's time to its
first token, and the wall time of the whole workload. Same sampled tokens in every
configuration. One process, configurations interleaved, best of ``--repeats``.

    python bench/prefill_micro.py [--shape small] [--rows 16] [--prompt-length 3584] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_micro import SHAPES  # noqa: E402
from tinsmith.devtools.tiny_model import make_tiny_model  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.sampling.sampler import Sampler, SampleTask  # noqa: E402
from tinsmith.types import SampleInput, SamplingParams  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_stall(model, rows: int, prompt_length: int, new_tokens: int, chunk: int, seed: int = 0) -> dict:
    """One run on a fresh sampler (no prefix cache) with prefill chunks of ``chunk`` tokens (0: whole).

    Returns the stall figures described in the module docstring, in milliseconds.
    """
    sampler = Sampler(model, lambda toks: "", prefix_cache_bytes=0, prefill_chunk_tokens=chunk,
                      max_rows=rows + 1)
    ends: list[float] = []  # wall time at the end of every decode step
    decode = sampler._decode_step

    def timed_decode(done: list) -> None:
        decode(done)
        _sync(sampler.device)
        ends.append(time.perf_counter())

    sampler._decode_step = timed_decode  # type: ignore[method-assign]
    assert new_tokens > 8, "the short rows must outlive the plain steps timed before the long prompt"
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=7)
    for i in range(rows):
        sampler.add(SampleTask(("row", i), None, SampleInput(rng.integers(4, vocab, 32), 1, params)))
    long = SampleTask("long", None, SampleInput(rng.integers(4, vocab, prompt_length), 1,
                                                SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=8)))
    t0 = time.perf_counter()
    while len(sampler.rows) < rows or len(ends) < 4:  # every short row decoding, a few plain steps timed
        sampler.step(0.01)
    arrived = time.perf_counter()
    sampler.add(long)
    first_token = None
    out: dict = {}
    while sampler.has_work():
        for key, res in sampler.step(0.01):
            if isinstance(res, Exception):
                raise res
            out[key] = res
        if first_token is None and ("long" in out or any(k == "long" for k, _, _ in sampler.running())):
            first_token = time.perf_counter()
    wall = time.perf_counter() - t0
    gaps = np.diff(ends)
    during = [g for g, t in zip(gaps, ends[1:]) if arrived < t and t - g <= first_token]
    plain = [g for g, t in zip(gaps, ends[1:]) if not (arrived < t and t - g <= first_token)]
    return {"max_stall_ms": round(1e3 * float(max(during, default=0.0)), 1),
            "plain_step_ms": round(1e3 * float(statistics.median(plain)), 2),
            "long_first_token_ms": round(1e3 * (first_token - arrived), 1),
            "wall_s": round(wall, 3), "chunks": sampler.stats["prefill_chunks"],
            "tokens": [int(t) for k in sorted(out, key=str) for s in out[k].sequences for t in s.tokens]}


def compare(model, rows: int, prompt_length: int, new_tokens: int, chunks: list[int], repeats: int) -> dict:
    """Best of ``repeats`` interleaved runs per chunk size (0 = whole prefill); checks that every
    configuration samples the same tokens."""
    best: dict = {}
    for _ in range(repeats):  # interleaved: a busy spell on the machine hits every configuration alike
        for chunk in chunks:
            r = decode_stall(model, rows, prompt_length, new_tokens, chunk)
            key = "whole" if chunk == 0 else f"chunk {chunk}"
            if key not in best or r["max_stall_ms"] < best[key]["max_stall_ms"]:
                best[key] = r
    tokens = {key: r.pop("tokens") for key, r in best.items()}
    same = all(t == tokens["whole"] for t in tokens.values()) if "whole" in tokens else None
    return {"rows": rows, "prompt_length": prompt_length, "same_tokens": same, "runs": best}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=3584)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--chunks", default="0,512,256", help="chunk sizes to compare (0: whole prefill)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default: torch's own; 1 suffers least from busy neighbours)")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory()
    model = load_model(str(make_tiny_model(Path(tmp.name) / "model", shape=SHAPES[a.shape]))).model
    chunks = [int(c) for c in a.chunks.split(",")]
    decode_stall(model, 2, 600, 16, 0)  # warm-up: first-call costs land in no figure
    res = compare(model, a.rows, a.prompt_length, a.new_tokens, chunks, a.repeats)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
           "shape": a.shape, "params": sum(p.numel() for p in model.parameters()), "args": vars(a), **res}
    print(f"{'prefill':<12} {'max stall ms':>13} {'plain step ms':>14} {'long TTFT ms':>13} {'wall s':>7} {'chunks':>7}")
    for key, r in res["runs"].items():
        print(f"{key:<12} {r['max_stall_ms']:>13.1f} {r['plain_step_ms']:>14.2f} {r['long_first_token_ms']:>13.1f} "
              f"{r['wall_s']:>7.2f} {r['chunks']:>7}")
    print("same tokens:", res["same_tokens"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
