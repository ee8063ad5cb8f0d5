"""Options: coerced by their declared type, and refused in one line when they cannot work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tinsmith.server.config import load_config


def test_environment_values_take_their_declared_types():
    c = load_config(None, {"TINSMITH_PORT": "9001", "TINSMITH_GRADIENT_CHECKPOINTING": "yes",
                           "TINSMITH_BASE_MODEL": "a, b", "TINSMITH_SEQ_GAP_WAIT_S": "0.5",
                           "TINSMITH_TRAIN_CHUNK_TOKENS": "1024"})
    assert (c.port, c.gradient_checkpointing, c.base_model, c.seq_gap_wait_s, c.train_chunk_tokens) == \
        (9001, True, ["a", "b"], 0.5, 1024)


@pytest.mark.parametrize("env, message", [
    ({"TINSMITH_PORT": "eighty"}, "--port must be int"),
    ({"TINSMITH_PORT": "70000"}, "--port must be between 1 and 65535"),
    ({"TINSMITH_TRAIN_CHUNK_TOKENS": "0"}, "--train-chunk-tokens must be at least 1"),
    ({"TINSMITH_MAX_NUM_SAMPLES": "-3"}, "--max-num-samples must be at least 1"),
    ({"TINSMITH_SEQ_GAP_WAIT_S": "-1"}, "--seq-gap-wait-s must not be negative"),
    ({"TINSMITH_SESSION_TIMEOUT_S": "0"}, "--session-timeout-s must be above 0"),
    ({"TINSMITH_METRIC_HISTORY_POINTS": "1"}, "--metric-history-points must be at least 2"),
])
def test_values_that_cannot_work_are_refused_naming_the_option(env, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, env)


def test_serve_prints_one_line_and_exits_non_zero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", "x",
                           "--seq-gap-wait-s", "-2", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tinsmith: --seq-gap-wait-s must not be negative (got -2.0)"
