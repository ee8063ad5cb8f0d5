"""Micro-benchmark: one key's sampling while another key keeps the server's HTTP layer busy.

The server's event loop (every HTTP request) and its sampler share one Python process, so they
take turns at the interpreter lock: CPU time the loop spends on one key's requests is time the
sampler does not spend on another key's rows. This measures what that costs. A real server of
this checkout (``tinsmith serve`` on a micro Qwen3, hidden 32 and 2 layers, so that decoding is
mostly host work, as on a GPU) answers the *sampling* key's ``num_samples`` x ``new`` tokens
(one request, random 128-token prompt) alone, then while the *busy* key's process sends
``GET /api/v1/get_server_capabilities`` (an authenticated call of the SDK's, answered from
memory) from ``--threads`` threads as fast as the answers come, each refused request (429)
retried after its ``Retry-After`` as the SDK does. Reported per round: the sampling key's
tokens/s alone and under load, their ratio, the busy key's requests/s answered and refused, and
the server's event-loop thread's share of the server's CPU.

``--rates`` runs one server after another, each with its ``--max-requests-per-second-per-key``
(``0``: no limit; ``default``: the server's default), so the rate limit is compared in one run.
The busy key starts ``--head-start`` seconds ahead: a key alone is never refused, so by the time
the sampling key asks, the busy key's burst is spent and the limit's steady state is measured.

On a machine with at least two cores the server runs on one core and the busy key's process on
another (``taskset``; ``--no-pin`` lets the scheduler place them), so the sampler and the event
loop split one core as a GPU server's threads split the interpreter lock: a fair split would
leave the sampler half of its speed alone. ``--switch-interval S`` sets the server's
``sys.setswitchinterval`` (through a ``sitecustomize`` this bench loads into it), to see whether
handing the lock over sooner changes the split.

    python bench/http_load_micro.py [--rates 0,default] [--threads 3] [--rounds 2] [--samples 16] [--new 256]
                                    [--head-start 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_times import cpu_seconds  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402

KEYS = {"sampling": "tml-bench-sampling", "busy": "tml-bench-busy"}

# Loaded into the server through PYTHONPATH: the interpreter's switch interval, when asked for.
_HOOK = """
import os, sys
if os.environ.get("HTTP_LOAD_SWITCH_S"):
    sys.setswitchinterval(float(os.environ["HTTP_LOAD_SWITCH_S"]))
"""

# The busy key's process: THREADS threads of GETs for SECONDS seconds, each refused one (429)
# retried after its Retry-After, as the SDK does; prints answered and refused requests/s.
_BUSY = """
import sys, threading, time, httpx
url, key, threads, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
done, refused = [0] * threads, [0] * threads
def run(i):
    with httpx.Client(headers={"X-API-Key": key}, timeout=60) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            r = c.get(url + "/api/v1/get_server_capabilities")
            if r.status_code == 429:
                refused[i] += 1
                time.sleep(float(r.headers.get("retry-after", 1)))
                continue
            r.raise_for_status()
            done[i] += 1
ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
print(sum(done) / seconds, sum(refused) / seconds)
"""


def _pinned(cmd: list[str], core: int | None) -> list[str]:
    return cmd if core is None else ["taskset", "-c", str(core), *cmd]


def one_round(client, srv: ServerProcess, prompt, params, samples: int, new: int, threads: int, busy_core,
              head_start: float) -> dict:
    """The sampling key's request alone, then under the busy key's load (started ``head_start`` s ahead)."""
    out: dict = {}
    for loaded in (False, True):
        busy = None
        if loaded:
            seconds = head_start + 1.0 + 3.0 * out["alone_s"] + 5.0  # outlasts the loaded request (at most ~3x slower)
            busy = subprocess.Popen(_pinned([sys.executable, "-c", _BUSY, srv.base_url, KEYS["busy"], str(threads),
                                             str(seconds)], busy_core), stdout=subprocess.PIPE, text=True)
            time.sleep(head_start)
        cpu, loop, t = cpu_seconds(srv.proc.pid), cpu_seconds(srv.proc.pid, srv.proc.pid), time.perf_counter()
        client.sample(prompt, samples, params).result(timeout=600)
        wall = time.perf_counter() - t
        cpu, loop = cpu_seconds(srv.proc.pid) - cpu, cpu_seconds(srv.proc.pid, srv.proc.pid) - loop
        key = "loaded" if loaded else "alone"
        out[f"{key}_s"], out[f"{key}_tokens_per_s"] = wall, samples * new / wall
        out[f"{key}_loop_cpu_share"] = loop / cpu if cpu > 0 else 0.0
        if busy is not None:
            answered, refused = busy.communicate(timeout=600)[0].split()
            out["busy_requests_per_s"], out["busy_refused_per_s"] = float(answered), float(refused)
    out["ratio"] = out["loaded_tokens_per_s"] / out["alone_tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=3, help="the busy key's threads of requests")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16, help="num_samples of the sampling key's request")
    ap.add_argument("--new", type=int, default=256, help="new tokens of each sample")
    ap.add_argument("--switch-interval", type=float, default=None, help="the server's sys.setswitchinterval, s")
    ap.add_argument("--no-pin", action="store_true", help="leave the server and the busy key's process unpinned")
    ap.add_argument("--rates", default="0,default",
                    help="the servers' --max-requests-per-second-per-key, one server each, in turn (0: no limit; "
                         "default: the server's default)")
    ap.add_argument("--head-start", type=float, default=10.0,
                    help="seconds the busy key sends alone before the sampling key's request (a key alone is "
                         "never refused; by then its burst is spent)")
    ap.add_argument("--json")
    args = ap.parse_args()
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    server_core, busy_core = (1, 0) if pin else (None, None)
    results = []
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=2, num_key_value_heads=1)
        model = make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        keys = Path(d) / "keys.txt"
        keys.write_text("".join(k + "\n" for k in KEYS.values()))
        hook = Path(d) / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        env = {"PYTHONPATH": os.pathsep.join([str(hook), str(Path(__file__).resolve().parents[1])])}
        if args.switch_interval is not None:
            env["HTTP_LOAD_SWITCH_S"] = str(args.switch_interval)
        for n, rate in enumerate(args.rates.split(",")):
            extra = ["--device", "cpu"] + ([] if rate == "default" else ["--max-requests-per-second-per-key", rate])
            srv = ServerProcess(model, Path(d) / f"data{n}", api_keys_file=keys, extra_args=extra,
                                log_dir=Path(d), env=env)
            srv.start(timeout=600)
            try:
                results += _rounds(args, srv, model, rate, server_core, busy_core)
            finally:
                srv.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"pinned": pin, "switch_interval": args.switch_interval,
                                               "threads": args.threads, "head_start": args.head_start,
                                               "rounds": results}, indent=2))


def _rounds(args, srv: ServerProcess, model: Path, rate: str, server_core, busy_core) -> list[dict]:
    """``args.rounds`` rounds on one server whose request rate per key is ``rate``."""
    import tinker
    from tinker import types

    if server_core is not None:  # the server's threads, and any it starts later, on one core
        subprocess.run(["taskset", "-a", "-p", "-c", str(server_core), str(srv.proc.pid)], check=True,
                       capture_output=True)
    client = tinker.ServiceClient(base_url=srv.base_url, api_key=KEYS["sampling"]).create_sampling_client(
        base_model=str(model)).result(timeout=600)
    rng = np.random.default_rng(0)
    params = types.SamplingParams(max_tokens=args.new, temperature=1.0, stop=[])
    client.sample(types.ModelInput.from_ints(rng.integers(4, 2000, 128).tolist()), args.samples,
                  params).result(timeout=600)  # warm
    results = []
    for r in range(args.rounds):
        prompt = types.ModelInput.from_ints(rng.integers(4, 2000, 128).tolist())
        res = one_round(client, srv, prompt, params, args.samples, args.new, args.threads, busy_core, args.head_start)
        res["rate"] = rate
        results.append(res)
        print(f"rate {rate}, round {r}: sampling key {res['alone_tokens_per_s']:.0f} tok/s alone, "
              f"{res['loaded_tokens_per_s']:.0f} tok/s while the busy key had {res['busy_requests_per_s']:.0f} "
              f"requests/s answered and {res['busy_refused_per_s']:.1f} refused: {res['ratio']:.3f}x (the event "
              f"loop's share of the server's CPU {res['alone_loop_cpu_share']:.2f} alone, "
              f"{res['loaded_loop_cpu_share']:.2f} loaded)", flush=True)
    return results


if __name__ == "__main__":
    main()
