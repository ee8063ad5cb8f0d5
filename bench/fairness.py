"""Heavy neighbours: what an idle tenant and a checkpointing tenant see while others train hard.

    .venv/bin/python bench/fairness.py                     # 16 busy keys + one huge-step key, 60 s
    .venv/bin/python bench/fairness.py --repo ../old-main  # the same load against another checkout
    .venv/bin/python bench/fairness.py --busy 4 --seconds 20 --json out.json

Every tenant has its own API key (``--api-keys-file``). First the server is quiet: the *probe*
key's one-datum forward and the *io* key's save_state / load_state are timed alone. Then
``--busy`` keys run pipelined SFT steps (forward_backward + optim_step) non-stop, one *heavy*
key sends huge forward_backward calls, and the probe and io keys go on measuring. Reported:
latency percentiles quiet vs busy, the micro-batch time (its tokens / busy throughput: the
"one micro-batch" a small request may have to wait for), throughput, errors, requests that
never resolved, and the server's resident memory before and after the busy phase. The probe's
latencies are also read from the server's store (arrival to result: what the server took, apart
from the HTTP path and the client threads that share the machine).

The slow test tier runs this with assertions (tests/load/test_heavy_neighbours.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.suite import free_port, wait_healthy  # noqa: E402

MICRO_BATCH_TOKENS_CPU = 2048  # the server's training micro-batch on CPU (automatic size)


@dataclass
class LoadConfig:
    busy: int = 16  # keys running SFT steps non-stop
    busy_batch: int = 4
    busy_length: int = 128
    heavy_batch: int = 32  # the heavy key's forward_backward: heavy_batch x heavy_length tokens
    heavy_length: int = 1024
    seconds: float = 60.0  # length of the busy phase
    probe_every_s: float = 0.25
    io_every_s: float = 2.0
    quiet_samples: int = 30


@dataclass
class Tally:
    """Thread-safe counters and latency lists."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    tokens: int = 0
    submitted: int = 0
    resolved: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, what: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(what, []).append(seconds)

    def count(self, submitted: int = 0, resolved: int = 0, tokens: int = 0) -> None:
        with self.lock:
            self.submitted += submitted
            self.resolved += resolved
            self.tokens += tokens

    def error(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{where}: {type(exc).__name__}: {str(exc)[:300]}")


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    a = np.sort(np.asarray(xs))
    return {"n": len(xs), "p50_ms": 1000 * float(np.percentile(a, 50)), "p99_ms": 1000 * float(np.percentile(a, 99)),
            "max_ms": 1000 * float(a[-1])}


def rss_summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    """Resident memory over the busy phase: start, end, and its growth rate over the last two
    thirds (allocators settle during the first third; a leak keeps growing)."""
    if len(samples) < 3:
        return {}
    t = np.array([x for x, _ in samples])
    m = np.array([y for _, y in samples])
    late = t >= t[-1] / 3
    slope = float(np.polyfit(t[late], m[late], 1)[0]) if late.sum() >= 2 else float("nan")
    return {"start": float(m[0]), "end": float(m[-1]), "peak": float(m.max()), "late_growth_mb_per_min": 60 * slope}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Tenant:
    """One API key with one LoRA training client."""

    def __init__(self, url: str, key: str, model: str, vocab: int, seed: int):
        import tinker

        self.sc = tinker.ServiceClient(base_url=url, api_key=key)
        self.tc = self.sc.create_lora_training_client(base_model=model, rank=8, seed=seed).result(timeout=120)
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def batch(self, n: int, length: int):
        from tinker import types

        out = []
        for _ in range(n):
            t = self.rng.integers(1, self.vocab, length + 1).tolist()
            out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                   loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * length}))
        return out

    def close(self) -> None:
        try:
            self.sc.close("success").result(timeout=30)
        except Exception:  # noqa: BLE001 - best effort at the end of a benchmark
            pass


def _timed(tally: Tally, what: str, fn) -> None:
    t = time.perf_counter()
    tally.count(submitted=1)
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        tally.error(what, exc)
    else:
        tally.add(what, time.perf_counter() - t)
    finally:
        tally.count(resolved=1)


def run_load(url: str, model: str, vocab: int, keys: dict[str, str], cfg: LoadConfig, server_pid: int | None = None,
             log=print, database: Path | None = None) -> dict:
    """Drive the server at ``url``; ``keys`` maps role ('probe', 'io', 'heavy', 'busy0'...) to API key.
    ``database``: the server's SQLite file, to report the probe's latencies as the server saw them
    (stored to completed) beside the client's."""
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-4)
    probe = Tenant(url, keys["probe"], model, vocab, seed=1)
    io = Tenant(url, keys["io"], model, vocab, seed=2)
    small = probe.batch(1, 16)
    io_step = io.batch(1, 32)
    quiet, busy = Tally(), Tally()

    def save_then_load(tally: Tally, i: int) -> None:
        io.tc.forward_backward(io_step, "cross_entropy").result(timeout=120)
        io.tc.optim_step(adam).result(timeout=120)
        holder: dict = {}
        _timed(tally, "save_state", lambda: holder.setdefault("path", io.tc.save_state(f"s{i}").result(timeout=300).path))
        if "path" in holder:
            _timed(tally, "load_state", lambda: io.tc.load_state(holder["path"]).result(timeout=300))

    # ---- quiet
    probe.tc.forward(small, "cross_entropy").result(timeout=120)  # warm
    for _ in range(cfg.quiet_samples):
        _timed(quiet, "probe_forward", lambda: probe.tc.forward(small, "cross_entropy").result(timeout=120))
    for i in range(3):
        save_then_load(quiet, i)
    log(f"quiet: probe {percentiles(quiet.latencies.get('probe_forward', []))}")

    # ---- busy
    tenants = [Tenant(url, keys[f"busy{i}"], model, vocab, seed=10 + i) for i in range(cfg.busy)]
    heavy = Tenant(url, keys["heavy"], model, vocab, seed=99)
    stop = threading.Event()

    def busy_loop(t: Tenant) -> None:
        data = t.batch(cfg.busy_batch, cfg.busy_length)
        while not stop.is_set():
            def step():
                fb = t.tc.forward_backward(data, "cross_entropy")
                op = t.tc.optim_step(adam)
                fb.result(timeout=600)
                op.result(timeout=600)
            _timed(busy, "busy_step", step)
            busy.count(tokens=cfg.busy_batch * cfg.busy_length)

    def heavy_loop() -> None:
        data = heavy.batch(cfg.heavy_batch, cfg.heavy_length)
        while not stop.is_set():
            _timed(busy, "heavy_step", lambda: heavy.tc.forward_backward(data, "cross_entropy").result(timeout=900))
            busy.count(tokens=cfg.heavy_batch * cfg.heavy_length)

    def probe_loop() -> None:
        pause = np.random.default_rng(5)
        while not stop.is_set():
            _timed(busy, "probe_forward", lambda: probe.tc.forward(small, "cross_entropy").result(timeout=600))
            # a random pause, so that the probes do not lock onto the server's chunk rhythm
            stop.wait(cfg.probe_every_s * pause.uniform(0.2, 1.8))

    def io_loop() -> None:
        i = 100
        while not stop.is_set():
            save_then_load(busy, i)
            i += 1
            stop.wait(cfg.io_every_s)

    for t in tenants:  # one step each before the clock starts
        t.tc.forward_backward(t.batch(1, 16), "cross_entropy").result(timeout=300)
    busy_from = time.time()
    threads = [threading.Thread(target=busy_loop, args=(t,), daemon=True) for t in tenants]
    threads += [threading.Thread(target=f, daemon=True) for f in (heavy_loop, probe_loop, io_loop)]
    rss: list[tuple[float, float]] = []  # (seconds into the busy phase, server RSS MB)
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    while not stop.wait(1.0):
        if server_pid:
            rss.append((time.perf_counter() - t0, rss_mb(server_pid)))
        if time.perf_counter() - t0 >= cfg.seconds:
            stop.set()
    for th in threads:
        th.join(timeout=900)
    wall = time.perf_counter() - t0
    hung = sum(th.is_alive() for th in threads)
    for t in [probe, io, heavy, *tenants]:
        t.close()

    throughput = busy.tokens / wall
    micro_batch_s = MICRO_BATCH_TOKENS_CPU / throughput if throughput else float("nan")
    q, b = percentiles(quiet.latencies.get("probe_forward", [])), percentiles(busy.latencies.get("probe_forward", []))
    server = {}
    if database is not None:  # the probe's forward calls as the server took them, quiet and busy
        from bench.store_times import request_times
        from tinsmith.api.auth import owner_for_key

        took = [(c, d - c) for c, d in request_times(database, "forward", owner_for_key(keys["probe"]))]
        sq = percentiles([s for c, s in took if c < busy_from])
        sb = percentiles([s for c, s in took if c >= busy_from])
        server = {"probe_server": {"quiet": sq, "busy": sb},
                  "probe_server_p99_ms": sb.get("p99_ms", float("nan")),
                  "probe_server_p99_bound_ms": 2 * sq.get("p99_ms", float("nan")) + 1000 * micro_batch_s}
    return {
        **server,
        "config": cfg.__dict__,
        "quiet": {k: percentiles(v) for k, v in quiet.latencies.items()},
        "busy": {k: percentiles(v) for k, v in busy.latencies.items()},
        "busy_tokens_per_s": throughput,
        "micro_batch_ms": 1000 * micro_batch_s,
        "probe_p99_bound_ms": 2 * q.get("p99_ms", float("nan")) + 1000 * micro_batch_s,
        "probe_p99_ms": b.get("p99_ms", float("nan")),
        "probe_ms": [round(1000 * x, 1) for x in busy.latencies.get("probe_forward", [])],
        "errors": quiet.errors + busy.errors,
        "unresolved": (quiet.submitted - quiet.resolved) + (busy.submitted - busy.resolved) + hung,
        "server_rss_mb": rss_summary(rss),
        "wall_s": wall,
    }


def start_server(repo: Path, model_dir: Path, work: Path, keys_file: Path,
                 log_level: str = "warning", extra: list[str] = ()) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", str(model_dir), "--port", str(port),
         "--data-dir", str(work / "data"), "--api-keys-file", str(keys_file), "--log-level", log_level, *extra],
        stdout=log, stderr=subprocess.STDOUT, cwd=repo,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url, proc


def key_roles(busy: int) -> dict[str, str]:
    roles = ["probe", "io", "heavy"] + [f"busy{i}" for i in range(busy)]
    return {r: f"tml-bench-{r}" for r in roles}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=str(ROOT), help="checkout whose server to run (default: this one)")
    p.add_argument("--model", help="model directory (default: a ~4.2M-parameter Qwen3 made on the spot)")
    p.add_argument("--busy", type=int, default=LoadConfig.busy)
    p.add_argument("--seconds", type=float, default=LoadConfig.seconds)
    p.add_argument("--heavy-batch", type=int, default=LoadConfig.heavy_batch)
    p.add_argument("--heavy-length", type=int, default=LoadConfig.heavy_length)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--server-log-level", default="warning", help="the server's --log-level (its log: WORK/server.log)")
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable), e.g. "
                   "--server-arg=--train-chunk-tokens=1024")
    a = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tinsmith.devtools.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="tinsmith-fairness-"))
    model_dir = Path(a.model) if a.model else make_tiny_model(work / "tiny-qwen3", "qwen3")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    keys = key_roles(a.busy)
    keys_file = work / "keys.txt"
    keys_file.write_text("".join(k + "\n" for k in keys.values()))
    url, proc = start_server(Path(a.repo).resolve(), model_dir, work, keys_file, a.server_log_level, a.server_arg)
    print(f"server log: {work / 'server.log'}", file=sys.stderr)
    cfg = LoadConfig(busy=a.busy, seconds=a.seconds, heavy_batch=a.heavy_batch, heavy_length=a.heavy_length)
    try:
        res = run_load(url, str(model_dir), vocab, keys, cfg, server_pid=proc.pid,
                       database=work / "data" / "tinsmith.sqlite")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    res["repo"] = str(Path(a.repo).resolve())
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
