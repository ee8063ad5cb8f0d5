"""``tinsmith demo`` end to end: pre-train, serve, RL through the SDK; the reward must rise (slow)."""

from __future__ import annotations

import json
import time

import pytest

from tinsmith.demo.pretrain import PretrainConfig, ensure_model
from tinsmith.demo.run import DemoConfig, run_demo

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_short_demo_writes_its_outputs_and_the_reward_rises(tmp_path):
    lines: list[str] = []
    out, model_dir = tmp_path / "out", tmp_path / "model"
    summary = run_demo(DemoConfig(out_dir=str(out), model_dir=str(model_dir), steps=STEPS), log=lines.append)

    # One progress line per step, with reward, loss and both throughputs.
    progress = [s for s in lines if s.startswith("step ")]
    assert len(progress) == STEPS
    for s in progress:
        assert "reward" in s and "loss" in s and "sample" in s and "train" in s and "tok/s" in s

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["exact_match"] <= 1.0
        assert r["sampled_tokens"] > 0 and r["sample_tokens_per_s"] > 0
    assert sum(r["trained_sequences"] for r in records) > 0

    png = (out / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "server.log").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS

    # The starting model is partially competent, and RL improves it clearly.
    start = summary["starting_model"]["held_out_exact_match"]
    assert 0.55 <= start["greedy"] < 1.0 and start["sampled"] < 0.6
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    assert last > first + 0.1, f"mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}"

    # A second call finds the cached model instead of pre-training again.
    cached: list[str] = []
    t0 = time.perf_counter()
    again, meta = ensure_model(model_dir, PretrainConfig(), log=cached.append)
    assert again == model_dir
    assert time.perf_counter() - t0 < 5 and "cached" in cached[0]
    assert meta["stats"] == summary["starting_model"]
