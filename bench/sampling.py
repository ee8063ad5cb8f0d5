"""Sampling benchmark: a tinsmith server on a tiny Qwen3, driven through the tinker SDK.

    .venv/bin/python bench/sampling.py [--model DIR] [--port P] [--repeats N] [--json OUT]
    .venv/bin/python bench/sampling.py --peer-url http://127.0.0.1:8100 \\
        --peer-python .venv-sdk-0.22.2/bin/python [--peer-model NAME]

Workloads (a warm-up run first, then the median of ``--repeats`` timed runs):

* ``a``: 4 prompts x 4 samples x 64 tokens (``stop=[]``, so every sequence runs full length),
  all submitted at once; sampled tokens / wall time.
* ``b``: 64 concurrent single-sample requests x 64 tokens; sampled tokens / wall time.
* ``c``: latency of one ``max_tokens=1`` scoring call (prompt logprobs of a 64-token prompt),
  requests one after another.
* ``d``: the request path: 128 concurrent single-sample requests of one new token each (GRPO's
  separate requests, without the decoding); requests per second and wall ms per request.

Without ``--model`` a ~4.2M-parameter Qwen3 (``make_tiny_model``'s default shape) is made in a
temporary directory. ``--peer-url`` also runs workload ``a`` against an already running peer
server, using the tinker SDK of ``--peer-python`` in a subprocess (the SkyRL peer speaks only
the JSON wire of SDK <= 0.22.2), and, for a same-SDK comparison, against tinsmith with that
interpreter too. This file runs under that interpreter as well (``--workload``), so its top
level imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "tml-bench-sampling"
TOKENS = 64


# ------------------------------------------------------------------------------------ workloads
def _sampler(url: str, base_model: str):
    """A base-model SamplingClient with whichever tinker SDK is installed (0.22.x or newer)."""
    import tinker

    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    s = sc.create_sampling_client(base_model=base_model)
    if hasattr(s, "result") and not isinstance(s, tinker.SamplingClient):  # newer SDKs return a future
        s = s.result()
    return s


def _prompts(n: int, length: int, vocab: int, seed: int = 0):
    import random

    from tinker import types

    rng = random.Random(seed)
    return [types.ModelInput.from_ints([rng.randrange(4, vocab) for _ in range(length)]) for _ in range(n)]


def _timed_batch(sampler, prompts, num_samples: int, max_tokens: int) -> tuple[int, float]:
    """Submit every prompt at once; (sampled tokens, wall seconds) once all have finished."""
    import asyncio

    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])

    async def go():
        return await asyncio.gather(*[sampler.sample_async(p, num_samples, params) for p in prompts])

    t = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t
    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
    return tokens, wall


def _throughput(sampler, prompts, num_samples: int, repeats: int) -> dict:
    _timed_batch(sampler, prompts, num_samples, 8)  # warm-up: first requests, first shapes
    _timed_batch(sampler, prompts, num_samples, TOKENS)
    runs = [_timed_batch(sampler, prompts, num_samples, TOKENS) for _ in range(repeats)]
    rates = [tok / wall for tok, wall in runs]
    expected = len(prompts) * num_samples * TOKENS
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "tokens": runs[0][0], "expected_tokens": expected, "wall_s": statistics.median(w for _, w in runs),
            "repeats": repeats}


def workload_a(url: str, base_model: str, repeats: int, vocab: int) -> dict:
    return _throughput(_sampler(url, base_model), _prompts(4, 16, vocab, seed=1), 4, repeats)


def workload_b(url: str, base_model: str, repeats: int, vocab: int) -> dict:
    return _throughput(_sampler(url, base_model), _prompts(64, 16, vocab, seed=2), 1, repeats)


def workload_c(url: str, base_model: str, repeats: int, vocab: int) -> dict:
    from tinker import types

    sampler = _sampler(url, base_model)
    (prompt,) = _prompts(1, 64, vocab, seed=3)
    params = types.SamplingParams(max_tokens=1, temperature=0.0)

    def once() -> float:
        t = time.perf_counter()
        r = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result()
        assert len(r.sequences[0].tokens) == 1 and r.prompt_logprobs is not None
        return time.perf_counter() - t

    for _ in range(3):
        once()
    calls = max(10, 4 * repeats)
    times = [once() for _ in range(calls)]
    return {"latency_ms": 1000 * statistics.median(times), "min": 1000 * min(times), "max": 1000 * max(times),
            "calls": calls}


def workload_d(url: str, base_model: str, repeats: int, vocab: int) -> dict:
    sampler = _sampler(url, base_model)
    prompts = _prompts(128, 16, vocab, seed=4)
    _timed_batch(sampler, prompts, 1, 1)  # warm-up
    walls = [_timed_batch(sampler, prompts, 1, 1)[1] for _ in range(max(3, repeats))]
    wall = statistics.median(walls)
    return {"requests_per_s": len(prompts) / wall, "min": len(prompts) / max(walls), "max": len(prompts) / min(walls),
            "ms_per_request": 1000 * wall / len(prompts), "requests": len(prompts), "repeats": len(walls)}


WORKLOADS = {"a": workload_a, "b": workload_b, "c": workload_c, "d": workload_d}


# ------------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise SystemExit(f"server exited with code {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/api/v1/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no healthy server at {url} after {timeout:.0f} s")


def start_tinsmith(model: Path, port: int, data_dir: Path, threads: int | None) -> tuple[subprocess.Popen, Path]:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    return proc, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_with(python: str, workload: str, url: str, base_model: str, repeats: int, vocab: int) -> dict:
    """Run one workload in a subprocess of another interpreter (another tinker SDK)."""
    cmd = [python, str(Path(__file__).resolve()), "--workload", workload, "--url", url, "--base-model", base_model,
           "--repeats", str(repeats), "--vocab", str(vocab)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def sdk_version(python: str) -> str:
    p = subprocess.run([python, "-c", "import tinker; print(tinker.__version__)"], capture_output=True, text=True,
                       check=False)
    return p.stdout.strip() or "?"


# ------------------------------------------------------------------------------------ report
LABELS = {
    "a": "(a) 4 prompts x 4 samples x 64 tok",
    "b": "(b) 64 concurrent requests x 64 tok",
    "c": "(c) max_tokens=1 scoring call",
    "d": "(d) 128 concurrent requests x 1 tok",
}


def table(rows: list[dict]) -> str:
    head = f"{'server':<10} {'sdk':<8} {'workload':<38} {'median':>12} {'min':>10} {'max':>10}  detail"
    lines = [head, "-" * len(head)]
    for r in rows:
        res = r["result"]
        if "latency_ms" in res:
            med, lo, hi, unit = res["latency_ms"], res["min"], res["max"], "ms"
            detail = f"{res['calls']} calls"
        elif "requests_per_s" in res:
            med, lo, hi, unit = res["requests_per_s"], res["min"], res["max"], "r/s"
            detail = f"{res['ms_per_request']:.1f} ms a request, {res['requests']} requests, {res['repeats']} repeats"
        else:
            med, lo, hi, unit = res["tokens_per_s"], res["min"], res["max"], "tok/s"
            detail = f"{res['tokens']}/{res['expected_tokens']} tokens in {res['wall_s']:.3f} s, {res['repeats']} repeats"
        lines.append(f"{r['server']:<10} {r['sdk']:<8} {LABELS[r['workload']]:<38} {med:>8.1f} {unit:<3} "
                     f"{lo:>10.1f} {hi:>10.1f}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: make a ~4.2M Qwen3 in a temporary directory)")
    p.add_argument("--port", type=int, default=0, help="port for the tinsmith server (default: a free one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS for the tinsmith server (default: torch's own choice)")
    p.add_argument("--workloads", default="abc", help="which of a, b, c, d to run against tinsmith")
    p.add_argument("--peer-url", help="an already running peer server: run workload a against it too")
    p.add_argument("--peer-python", default=str(ROOT / ".venv-sdk-0.22.2" / "bin" / "python"),
                   help="interpreter whose tinker SDK drives the peer")
    p.add_argument("--peer-model", help="base_model name the peer serves (default: the model directory)")
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    # internal: run one workload against --url and print its result as JSON
    p.add_argument("--workload", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--base-model", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    if a.workload:
        print(json.dumps(WORKLOADS[a.workload](a.url, a.base_model, a.repeats, a.vocab)))
        return

    sys.path.insert(0, str(ROOT))
    import tinker

    tmp = Path(tempfile.mkdtemp(prefix="tinsmith-bench-sampling-"))
    if a.model:
        model = Path(a.model).resolve()
    else:
        from tinsmith.devtools.tiny_model import make_tiny_model

        model = make_tiny_model(tmp / "tiny-qwen3", "qwen3")  # ~4.2M parameters
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    port = a.port or free_port()
    url = f"http://127.0.0.1:{port}"
    rows: list[dict] = []
    proc, _ = start_tinsmith(model, port, tmp / "data", a.threads or None)
    try:
        for w in a.workloads:
            res = WORKLOADS[w](url, str(model), a.repeats, vocab)
            rows.append({"server": "tinsmith", "sdk": tinker.__version__, "workload": w, "result": res})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        if a.peer_url:
            peer_sdk = sdk_version(a.peer_python)
            res = run_with(a.peer_python, "a", url, str(model), a.repeats, vocab)
            rows.append({"server": "tinsmith", "sdk": peer_sdk, "workload": "a", "result": res})
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    if a.peer_url:
        wait_healthy(a.peer_url.rstrip("/"), None, None, timeout=30)
        res = run_with(a.peer_python, "a", a.peer_url.rstrip("/"), a.peer_model or str(model), a.repeats, vocab)
        rows.append({"server": "peer", "sdk": sdk_version(a.peer_python), "workload": "a", "result": res})

    print()
    print(f"model: {'(temporary) ' if not a.model else ''}{model} (vocab {vocab}); tinsmith server threads: {a.threads or 'default'}; "
          f"cpu count: {os.cpu_count()}; load average: {os.getloadavg()[0]:.1f}")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": str(model), "threads": a.threads or None, "rows": rows,
                                            "load_average": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
