"""bench/sdk_step_micro.py runs on the CPU: a training step through the SDK split by the server's store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sdk_step_micro.py"


def test_a_step_through_the_sdk_is_split_into_the_servers_parts_and_the_rest(tmp_path):
    spec = importlib.util.spec_from_file_location("sdk_step_micro", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.make_tiny_model(tmp_path / "m", "qwen3", bench.SHAPE, seed=0)
    trainer = bench.SdkTrainer(model, tmp_path / "data", SCRIPT.parents[1], None, None)
    try:
        trainer.step()
        out = trainer.timed(3)
    finally:
        trainer.close()
    assert out["steps"] == 3  # every timed step's two requests found in the server's store
    for part in ("forward_backward_run_ms", "optim_step_run_ms", "server_span_ms", "step_ms"):
        assert 0 < out[part] < 60_000, part
    assert out["server_span_ms"] >= out["forward_backward_run_ms"] + out["optim_step_run_ms"]
    assert out["server_cpu_ms_per_step"] > 0 and out["client_cpu_ms_per_step"] > 0
    assert 0 < bench.in_process(model, 2, None) < 60_000
