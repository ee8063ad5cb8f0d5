"""A key's one sample request while another key has hundreds queued, through the SDK.

The sampler holds at most 256 rows. The *busy* key sends ``--busy`` single-sample requests at
once (random 32-token prompts, 16 to 64 new tokens each), so most of them wait for rows; once the
server has stored them all, the *light* key sends one request of one new token (so that its
latency is its wait for a row, not its own decoding in a batch of 256 rows). Reported: the light request's
latency with the server quiet and with the busy key's queue in front of it, as the client saw it
and as the server's store recorded it (from its arrival to its result: the client's own queue of
the busy key's POSTs left out), and when the busy key's last request completed. Each key is its
own API key (``--api-keys-file``), as tenants are.

With ``--long N`` every busy request asks for exactly N new tokens instead: ``--busy 256 --long
512`` fills every row with generations that all end together, so the light request waits for a
row until the sampler takes one back for it (a key below its fair share), or until they end.

    python bench/sampling_fairness.py [--busy 768] [--long 0] [--rounds 2] [--json out.json]

Run it from another checkout (its own ``bench/``) to compare: the server started is the
checkout's that the command runs in.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.store_times import request_spans  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tinsmith.api.auth import owner_for_key  # noqa: E402
from tinsmith.devtools.tiny_model import make_tiny_model  # noqa: E402

KEYS = {"busy": "tml-bench-busy", "light": "tml-bench-light"}


def stored(database: Path, key: str) -> int:
    """Sample requests of ``key`` in the server's store (finished or not)."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as con:
        return con.execute("select count(*) from requests where kind = 'sample' and owner = ?",
                           (owner_for_key(key),)).fetchone()[0]


def decoding_rows(base_url: str) -> int:
    """Sequences the server's samplers are decoding (``tinsmith_sampler_rows`` on ``/metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        if family.name == "tinsmith_sampler_rows":
            return int(sum(s.value for s in family.samples))
    return 0


def one_round(busy_client, light_client, busy: int, rng: np.random.Generator, database: Path,
              expected_busy: int, long: int = 0, base_url: str = "") -> dict:
    from tinker import types

    def prompt() -> types.ModelInput:
        return types.ModelInput.from_ints(rng.integers(4, 2000, 32).tolist())

    light_params = types.SamplingParams(max_tokens=1, temperature=1.0, stop=[])
    quiet = []
    for _ in range(3):
        t = time.perf_counter()
        light_client.sample(prompt(), 1, light_params).result(timeout=600)
        quiet.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    futures = [busy_client.sample(prompt(), 1, types.SamplingParams(
        max_tokens=long or int(rng.integers(16, 65)), temperature=1.0, stop=[])) for _ in range(busy)]
    while stored(database, KEYS["busy"]) < expected_busy:  # the whole queue is in the server
        time.sleep(0.05)
    while long and decoding_rows(base_url) < min(busy, 256):  # and every row is decoding
        time.sleep(0.05)
    t = time.perf_counter()
    light_client.sample(prompt(), 1, light_params).result(timeout=600)
    light_busy = time.perf_counter() - t
    tokens = sum(len(f.result(timeout=1200).sequences[0].tokens) for f in futures)
    busy_s = time.perf_counter() - t0
    created, _, completed = request_spans(database, "sample", owner_for_key(KEYS["light"]))[-1]
    return {"light_quiet_s": statistics.median(quiet), "light_busy_s": light_busy,
            "light_busy_server_s": completed - created,
            "light_sent_after_s": t - t0, "busy_done_s": busy_s, "busy_tokens_per_s": tokens / busy_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=768)
    ap.add_argument("--long", type=int, default=0, help="new tokens of every busy request (0: 16 to 64 at random)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    import tinker

    results = []
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "m", "qwen3", seed=0)
        keys = Path(d) / "keys.txt"
        keys.write_text("".join(k + "\n" for k in KEYS.values()))
        srv = ServerProcess(model, Path(d) / "data", api_keys_file=keys, log_dir=Path(d))
        srv.start(timeout=600)
        try:
            clients = {role: tinker.ServiceClient(base_url=srv.base_url, api_key=key).create_sampling_client(
                base_model=str(model)) for role, key in KEYS.items()}
            rng = np.random.default_rng(0)
            for r in range(args.rounds):
                res = one_round(clients["busy"], clients["light"], args.busy, rng, Path(d) / "data" / "tinsmith.sqlite",
                                (r + 1) * args.busy, args.long, srv.base_url)
                results.append(res)
                print(f"round {r}: light key's request {1e3 * res['light_quiet_s']:.0f} ms quiet, "
                      f"{1e3 * res['light_busy_s']:.0f} ms behind {args.busy} of the busy key's "
                      f"({1e3 * res['light_busy_server_s']:.0f} ms in the server) "
                      f"(sent {res['light_sent_after_s']:.2f} s after them); the busy key's last done at "
                      f"{res['busy_done_s']:.2f} s ({res['busy_tokens_per_s']:.0f} tok/s)", flush=True)
        finally:
            srv.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"busy": args.busy, "long": args.long, "rounds": results}, indent=2))


if __name__ == "__main__":
    main()
