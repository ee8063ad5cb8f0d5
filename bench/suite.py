"""One command, every figure that matters, side by side with the peer on the same machine.

    .venv/bin/python bench/suite.py                 # tinsmith only
    .venv/bin/python bench/suite.py --peer          # + SkyRL via ../shared/peers/skyrl-serve.sh
    .venv/bin/python bench/suite.py --quick --json bench/results/latest.json

It makes a ~4.2M-parameter Qwen3 (or takes ``--model DIR``), measures the machine's matmul
rate (the FLOP bound: rate / (4 x params) tokens/s for LoRA forward+backward), starts each
server fresh, runs the same SDK workloads against it (``bench/workloads.py``; tinsmith with the
newest SDK, the peer with SDK 0.22.2, the last one it speaks) and prints a table plus JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fwdbwd_micro import matmul_rate  # noqa: E402

NEW_SDK = ROOT / ".venv" / "bin" / "python"
OLD_SDK = ROOT / ".venv-sdk-0.22.2" / "bin" / "python"
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "skyrl-serve.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} did not become healthy")


def tree_peak_rss_mb(pid: int) -> float:
    """Sum of VmHWM (peak resident set) over a process and its descendants."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / 1024


class Server:
    def __init__(self, name: str, url: str, pid: int, python: Path, model_name: str, stop):
        self.name, self.url, self.pid, self.python, self.model_name, self._stop = name, url, pid, python, model_name, stop

    def stop(self) -> None:
        self._stop()


def start_tinsmith(model_dir: Path, work: Path, sdk: Path) -> Server:
    port = free_port()
    log = open(work / "tinsmith.log", "w")
    proc = subprocess.Popen(
        [str(NEW_SDK), "-m", "tinsmith.cli", "serve", "--base-model", str(model_dir), "--port", str(port),
         "--data-dir", str(work / "tinsmith-data"), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)

    def stop() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()

    return Server("tinsmith", url, proc.pid, sdk, str(model_dir), stop)


def start_peer(model_dir: Path) -> Server:
    port = free_port()
    out = subprocess.run(["bash", str(PEER_SCRIPT), str(model_dir), str(port)], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"peer did not start: {out.stderr.strip()[-2000:]}")
    pid = int(out.stdout.strip().splitlines()[0])

    def stop() -> None:
        try:
            os.killpg(os.getpgid(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass

    return Server("skyrl", f"http://127.0.0.1:{port}", pid, OLD_SDK, str(model_dir), stop)


def run_workload(server: Server, workload: str, *args: str, timeout: float = 900) -> dict:
    cmd = [str(server.python), str(ROOT / "bench" / "workloads.py"), "--base-url", server.url, "--model",
           server.model_name, "--workload", workload, *args]
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "TINKER_TELEMETRY": "0"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t
    return res


def workloads(quick: bool) -> list[tuple[str, str, list[str], str]]:
    """(key, workload, args, the figure to report)."""
    steps = "4" if quick else "8"
    return [
        ("latency_ms", "latency", ["--steps", "20" if quick else "40"], "median_ms"),
        ("sft_8x128", "sft", ["--batch", "8", "--length", "128", "--steps", steps], "tokens_per_s"),
        ("sft_32x512", "sft", ["--batch", "32", "--length", "512", "--steps", "2" if quick else "4", "--warmup", "1"],
         "tokens_per_s"),
        ("first_step_s", "sft", ["--batch", "8", "--length", "128", "--steps", "1", "--warmup", "0"], "first_step_s"),
        ("sample_4x4x64", "sample", ["--prompts", "4", "--samples", "4", "--max-tokens", "64"], "tokens_per_s"),
        ("sample_64_concurrent", "sample_concurrent", ["--concurrency", "64", "--max-tokens", "64"], "tokens_per_s"),
        ("multitenant_1", "multitenant", ["--tenants", "1", "--steps", steps], "tokens_per_s"),
        ("multitenant_4", "multitenant", ["--tenants", "4", "--steps", steps], "tokens_per_s"),
        ("multitenant_16", "multitenant", ["--tenants", "16", "--steps", "2" if quick else "4"], "tokens_per_s"),
        ("rl_step_s", "rl_step", ["--prompts", "8", "--samples", "4", "--max-tokens", "32"], "median_step_s"),
    ]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory (default: a 4.2M Qwen3 made on the spot)")
    p.add_argument("--peer", action="store_true", help="also measure SkyRL (../shared/peers/skyrl-serve.sh)")
    p.add_argument("--old-sdk", action="store_true", help="also drive tinsmith with SDK 0.22.2 (same SDK as the peer)")
    p.add_argument("--quick", action="store_true", help="fewer steps per workload")
    p.add_argument("--only", help="comma-separated workload keys to run")
    p.add_argument("--json", help="write all results here")
    a = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tinsmith-bench-"))
    from tinsmith.devtools.tiny_model import make_tiny_model
    from tinsmith.models.loading import read_config, resolve_model_dir

    model_dir = Path(a.model) if a.model else make_tiny_model(work / "tiny-qwen3", "qwen3")
    cfg = read_config(resolve_model_dir(str(model_dir)))
    import torch

    rate = matmul_rate(torch.device("cpu"), torch.float32)
    bound = rate / (4 * cfg.num_params)
    chosen = workloads(a.quick)
    if a.only:
        keep = set(a.only.split(","))
        chosen = [w for w in chosen if w[0] in keep]
    vocab = str(min(cfg.vocab_size, 2000))

    columns: dict[str, dict] = {}
    targets = [("tinsmith", lambda: start_tinsmith(model_dir, work, NEW_SDK))]
    if a.old_sdk:
        targets.append(("tinsmith (SDK 0.22.2)", lambda: start_tinsmith(model_dir, work, OLD_SDK)))
    if a.peer:
        targets.append(("skyrl", lambda: start_peer(model_dir)))
    for label, starter in targets:
        print(f"== {label}", flush=True)
        try:
            server = starter()
        except Exception as e:  # the peer may fail to install or start; report, keep going
            columns[label] = {"error": str(e)}
            print(f"   could not start: {e}", flush=True)
            continue
        res: dict = {}
        try:
            for key, workload, args, figure in chosen:
                r = run_workload(server, workload, "--vocab", vocab, *args)
                res[key] = r
                shown = r.get(figure, r.get("error"))
                print(f"   {key:<22} {shown}", flush=True)
            res["peak_rss_mb"] = tree_peak_rss_mb(server.pid)
        finally:
            server.stop()
        columns[label] = res

    rows = [(k, fig) for k, _, _, fig in chosen]
    print()
    print(f"model {cfg.num_params / 1e6:.2f}M params; matmul {rate / 1e9:.0f} GFLOP/s fp32; "
          f"FLOP bound {bound:.0f} LoRA train tokens/s")
    header = f"{'figure':<24}" + "".join(f"{label:>24}" for label in columns)
    if "skyrl" in columns and "tinsmith" in columns:
        header += f"{'tinsmith/skyrl':>16}"
    print(header)
    for key, fig in rows + [("peak_rss_mb", None)]:
        line = f"{key:<24}"
        vals = []
        for label, res in columns.items():
            r = res.get(key)
            v = r if isinstance(r, (int, float)) else (r or {}).get(fig) if isinstance(r, dict) else None
            vals.append(v)
            line += f"{v:>24.1f}" if isinstance(v, (int, float)) else f"{'-':>24}"
        if "skyrl" in columns and "tinsmith" in columns:
            t, s = vals[list(columns).index("tinsmith")], vals[list(columns).index("skyrl")]
            line += f"{t / s:>16.2f}" if isinstance(t, float) and isinstance(s, float) and s else f"{'-':>16}"
        print(line)
    if "sft_8x128" in columns.get("tinsmith", {}):
        tps = columns["tinsmith"]["sft_8x128"].get("tokens_per_s")
        if tps:
            print(f"SFT 8x128 through the SDK reaches {100 * tps / bound:.0f}% of the FLOP bound")
    out = {"model_params": cfg.num_params, "matmul_flops_per_s": rate, "flop_bound_tokens_per_s": bound,
           "results": columns, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
