"""bench/gpu states each issue target as met, missed or unmeasured, from the run's own figures."""

from __future__ import annotations

from bench.gpu.report import _fmt
from bench.gpu.targets import TARGETS, evaluate, markdown


def _row(rows, what):
    return next(r for r in rows if r["what"] == what)


def test_targets_are_met_missed_or_unmeasured():
    summary = {
        "sample": {"1.7B/decode": {"rows_64": {"tokens_per_s": 30_000.0}, "rows_256": {"tokens_per_s": 50_000.0}},
                   "1.7B/sdk": {"first_call_s": 2.5, "grpo": {"separate_vs_num_samples": 0.85}}},
        "train": {"1.7B/lora": {"8x1024": {"mfu_4nt": 0.46, "tokens_per_s": 30_000.0}},
                  "1.7B/peft_baseline": {"tokens_per_s": 10_000.0},
                  "4B/lora": {"error": "out of memory"}},
    }
    rows = evaluate(summary)
    assert len(rows) == len(TARGETS)
    assert _row(rows, "decode, 64 rows, 1.7B (tok/s)")["met"] is True
    assert _row(rows, "decode, 256 rows, 1.7B (tok/s)")["met"] is False
    assert _row(rows, "first sample call after ready, 1.7B shape (s)")["met"] is False  # a latency: under it
    assert _row(rows, "GRPO as separate requests vs num_samples")["met"] is True
    ratio = _row(rows, "LoRA 8x1024 vs transformers+peft, 1.7B (tok/s ratio)")
    assert ratio["figure"] == 3.0 and ratio["met"] is True
    for what in ("LoRA 8x1024, 4B (MFU 4NT)", "decode, 256 rows, 8B (tok/s)", "8 adapters vs base model (decode)"):
        assert _row(rows, what)["figure"] is None and _row(rows, what)["met"] is None
    table = "\n".join(markdown(summary, _fmt))
    assert "| 13 | decode, 64 rows, 1.7B (tok/s) | 30,000 | >= 25,000 | yes |" in table
    assert "| 14 | LoRA 8x1024, 8B (MFU 4NT) | unmeasured | >= 0.5 | - |" in table
