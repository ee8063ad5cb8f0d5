"""Micro-benchmark: separate sample requests ending at scattered steps, on SQLite and Postgres.

RL samples completions of different lengths: requests end all through a decode, and the engine
stores the outcomes of each slice's finished requests (one transaction a slice) on the worker's
thread, before the next slice starts: every slice with an ending pays the write, and a commit on
Postgres waits for the database server and its log, so that store pays more. This measures the
whole path as a client sees it, to compare ways of writing (docs/performance.md has one that was
tried and measured slower).

One key submits ``--requests`` separate sample requests at once through the SDK, each with its
own ``max_tokens`` (drawn between ``--min-new`` and ``--max-new``, the same draws for every
server), on a micro Qwen3 (hidden 32, 2 layers: decoding is mostly host work, as on a GPU). A
round's wall time runs from the first submission to the last result. Every checkout of
``--checkouts`` (this one by default; e.g. ``/tmp/base,.`` for a worktree of an earlier commit
beside this one) serves every database of ``--databases``: the servers all start first (pinned
to one core, this client on the other), then take turns round by round, ``--rounds`` timed
rounds each after a warm one, so a before/after comparison is one run on one machine and its
drift falls on every server alike.

    python bench/result_writes_micro.py [--checkouts .] [--databases sqlite,postgres] [--requests 64]
                                        [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.server import ServerProcess  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402

PG_URL = os.environ.get("TINSMITH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


class PostgresSchemas:
    """Throw-away schemas on the Postgres server, one per benchmarked server."""

    def __init__(self, url: str) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        self.url = url
        plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(plain, connect_timeout=3, autocommit=True)
        self.made: list[str] = []

    def new_url(self) -> str:
        schema = f"tinsmith_bench_{uuid.uuid4().hex[:12]}"
        self.conn.execute(f'CREATE SCHEMA "{schema}"')
        self.made.append(schema)
        return f"{self.url}?options=-csearch_path%3D{schema}"

    def close(self) -> None:
        for schema in self.made:
            self.conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        self.conn.close()


def postgres_if_asked(databases: str) -> PostgresSchemas | None:
    """Throw-away schemas on the test Postgres server when ``databases`` (comma-separated) names
    postgres and the server answers; else None, having said why when it was asked for."""
    if "postgres" not in databases.split(","):
        return None
    try:
        return PostgresSchemas(PG_URL)
    except Exception as e:  # noqa: BLE001 - any failure to connect: say so and go on without it
        print(f"Postgres at {PG_URL} unreachable ({type(e).__name__}: {e}); SQLite only", flush=True)
        return None


def one_round(client, prompts, lengths: list[int]) -> float:
    """Seconds from the first submission to the last result of one request per length."""
    from tinker import types

    start = time.perf_counter()
    futures = [client.sample(prompt, 1, types.SamplingParams(max_tokens=n, temperature=1.0, stop=[]))
               for prompt, n in zip(prompts, lengths)]
    for f, n in zip(futures, lengths):
        assert len(f.result(timeout=600).sequences[0].tokens) == n
    return time.perf_counter() - start


def start_server(model: Path, data: Path, checkout: Path, database_url: str | None, core: int | None):
    """A server of ``checkout`` on ``database_url`` (None: SQLite), its threads pinned to ``core``,
    and a sampling client of it."""
    import tinker

    srv = ServerProcess(model, data, database_url=database_url, extra_args=["--device", "cpu"], checkout=checkout)
    srv.start(timeout=600)
    if core is not None:
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(srv.proc.pid)], check=True, capture_output=True)
    client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench").create_sampling_client(
        base_model=str(model)).result(timeout=600)
    return srv, client


def main() -> None:
    from tinker import types

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", default=".", help="comma-separated checkouts whose server runs, in turn")
    ap.add_argument("--databases", default="sqlite,postgres")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = np.random.default_rng(0).integers(args.min_new, args.max_new + 1, args.requests).tolist()
    tokens = sum(lengths)
    pg = postgres_if_asked(args.databases)
    pin = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    if pin:  # this process (the SDK's client) on one core, the servers on the other
        os.sched_setaffinity(0, {0})
    servers: list[tuple[str, str, ServerProcess, object]] = []
    walls: dict[tuple[str, str], list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            try:
                shape = TinyShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                                  num_attention_heads=2, num_key_value_heads=1)
                model = make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
                for database in args.databases.split(","):
                    if database == "postgres" and pg is None:
                        continue
                    for checkout in args.checkouts.split(","):
                        url = pg.new_url() if database == "postgres" else None
                        srv, client = start_server(model, Path(d) / f"data{len(servers)}", Path(checkout).resolve(),
                                                   url, 1 if pin else None)
                        servers.append((database, checkout, srv, client))
                rng = np.random.default_rng(1)
                prompts = [types.ModelInput.from_ints(rng.integers(4, 2000, 32).tolist()) for _ in lengths]
                for _, _, _, client in servers:
                    one_round(client, prompts, lengths)  # warm
                for _ in range(args.rounds):  # the servers take turns, round by round: the drift hits all
                    for database, checkout, _, client in servers:
                        walls.setdefault((database, checkout), []).append(one_round(client, prompts, lengths))
            finally:
                for _, _, srv, _ in servers:
                    srv.stop()
    finally:
        if pg is not None:
            pg.close()
    results = []
    for (database, checkout), w in walls.items():
        med = statistics.median(w)
        results.append({"database": database, "checkout": checkout, "walls_s": w, "tokens_per_s": tokens / med})
        print(f"{database:8s} {checkout}: {args.requests} requests, {tokens} tokens: "
              f"{', '.join(f'{x:.2f}' for x in w)} s, median {tokens / med:.0f} tokens/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": args.requests, "lengths": lengths, "rounds": results},
                                              indent=2))


if __name__ == "__main__":
    main()
