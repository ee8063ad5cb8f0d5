"""Micro-benchmark: the CPU one request costs the server's HTTP stack, in process.

Every SDK call passes the same layers before and after its handler: uvicorn's ASGI call, the
server's middleware (the request's metrics and log line, the per-key request rate, the body
limit), FastAPI's routing and dependencies (the caller's key), the body's parsing and the
answer's encoding. On a GPU server these run on the event loop, which shares the interpreter lock
with the sampler, so their CPU per request bounds how fast a burst of requests (GRPO's separate
samples) is taken in (docs/performance.md). This calls the real application (``create_app`` over a
``ServerState`` on a micro Qwen3) through httpx's ASGI transport, no sockets, with a cheap
authenticated route: ``retrieve_future`` of an unknown request (a 404 after a store read on a
worker thread). The client's own share (httpx building the request, reading the answer) is taken
out by timing the same calls to a bare ASGI app that answers at once. CPU seconds of the whole
process (``time.process_time``: the worker thread's too), per request, each round alternating
the two.

    python bench/http_stack_micro.py [--requests 500] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.api.app import create_app  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.gc_tuning import tuned_for_serving  # noqa: E402
from tinsmith.server.config import ServerConfig  # noqa: E402
from tinsmith.server.state import ServerState  # noqa: E402

ROUTE = "/api/v1/retrieve_future"
BODY = {"request_id": "not-a-request"}
HEADERS = {"X-API-Key": "tml-bench-http-stack"}


async def _bare(scope, receive, send) -> None:
    """An ASGI app that reads the body and answers 404 at once: the client's own cost."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def _cpu_per_request(client, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        await client.post(ROUTE, json=BODY, headers=HEADERS)
    return (time.process_time() - t) / n


async def measure(data_dir: Path, requests: int, rounds: int) -> dict:
    import httpx

    shape = TinyShape(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16, num_attention_heads=2,
                      num_key_value_heads=1)
    model = make_tiny_model(data_dir / "model", "qwen3", shape, seed=0)
    state = ServerState.build(ServerConfig(base_model=[str(model)], data_dir=str(data_dir / "server"), device="cpu",
                                           warm_up=False))
    app = create_app(state)
    server_ms, client_ms = [], []
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as served, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=_bare), base_url="http://bench") as bare:
            answer = await served.post(ROUTE, json=BODY, headers=HEADERS)
            if answer.status_code != 404:
                raise SystemExit(f"{ROUTE} answered {answer.status_code}, not 404: {answer.text}")
            await _cpu_per_request(served, min(requests, 100))  # warm: the routes' first calls, the store's statement
            for _ in range(rounds):
                full = await _cpu_per_request(served, requests)
                alone = await _cpu_per_request(bare, requests)
                server_ms.append(1e3 * (full - alone))
                client_ms.append(1e3 * alone)
                print(f"server's HTTP stack {server_ms[-1]:.3f} ms of CPU a request (the client's own "
                      f"{client_ms[-1]:.3f} ms taken out)", flush=True)
    return {"route": ROUTE, "requests_per_round": requests, "server_ms_per_request": server_ms,
            "client_ms_per_request": client_ms, "server_ms_median": statistics.median(server_ms)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="requests a round, each way")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d, tuned_for_serving():  # the collector as the server sets it
        out = asyncio.run(measure(Path(d), args.requests, args.rounds))
    print(f"median: {out['server_ms_median']:.3f} ms of CPU a request")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
