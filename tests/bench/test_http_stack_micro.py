"""bench/http_stack_micro.py runs on the CPU: the server's HTTP stack's CPU per request, in process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "http_stack_micro.py"


def test_the_stacks_cpu_per_request_is_measured_beside_the_clients():
    spec = importlib.util.spec_from_file_location("http_stack_micro", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--requests", "30", "--rounds", "2"])
    assert len(out["server_ms_per_request"]) == len(out["client_ms_per_request"]) == 2
    assert all(0 < ms < 1e3 for ms in out["client_ms_per_request"])  # httpx's own work, on any machine
    assert 0 < out["server_ms_median"] < 1e3  # the stack costs something beyond the bare answer
