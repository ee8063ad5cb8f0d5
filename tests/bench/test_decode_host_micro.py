"""bench/decode_host_micro.py runs on the CPU: the sampler's host work between decode steps, the
static step's own time left out, under a K/V budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_host_micro.py"


def test_host_work_per_step_is_timed_for_each_row_count(qwen3_dir):
    spec = importlib.util.spec_from_file_location("decode_host_micro", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--model", str(qwen3_dir), "--rows", "2,4", "--tokens", "8", "--repeats", "1"])
    for rows in (2, 4):
        ms = out[f"rows_{rows}"]["host_ms_per_step"]
        assert 0 < ms < 1e3, ms  # host work only: well under a second a step on any machine


def test_host_work_per_step_is_timed_with_adapters_beside_the_base_model(qwen3_dir):
    spec = importlib.util.spec_from_file_location("decode_host_micro", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--model", str(qwen3_dir), "--rows", "4", "--tokens", "8", "--repeats", "1", "--adapters", "0,2"])
    assert set(out) >= {"rows_4", "rows_4_adapters_2"}
    for key in ("rows_4", "rows_4_adapters_2"):
        assert 0 < out[key]["host_ms_per_step"] < 1e3, out
