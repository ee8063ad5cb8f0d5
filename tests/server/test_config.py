"""Options: coerced by their declared type, and refused in one line when they cannot work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinsmith.server.config import ConfigError, ServerConfig, flag_name, load_config


def test_environment_values_take_their_declared_types():
    c = load_config(None, {"TINSMITH_PORT": "9001", "TINSMITH_GRADIENT_CHECKPOINTING": "yes",
                           "TINSMITH_BASE_MODEL": "a, b", "TINSMITH_SEQ_GAP_WAIT_S": "0.5",
                           "TINSMITH_TRAIN_CHUNK_TOKENS": "1024"})
    assert (c.port, c.gradient_checkpointing, c.base_model, c.seq_gap_wait_s, c.train_chunk_tokens) == \
        (9001, True, ["a", "b"], 0.5, 1024)


@pytest.mark.parametrize("env, message", [
    ({"TINSMITH_PORT": "eighty"}, "TINSMITH_PORT must be an integer"),
    ({"TINSMITH_PORT": "70000"}, "TINSMITH_PORT must be between 1 and 65535"),
    ({"TINSMITH_TRAIN_CHUNK_TOKENS": "0"}, "TINSMITH_TRAIN_CHUNK_TOKENS must be at least 1"),
    ({"TINSMITH_MAX_NUM_SAMPLES": "-3"}, "TINSMITH_MAX_NUM_SAMPLES must be at least 1"),
    ({"TINSMITH_SEQ_GAP_WAIT_S": "-1"}, "TINSMITH_SEQ_GAP_WAIT_S must not be negative"),
    ({"TINSMITH_SESSION_TIMEOUT_S": "0"}, "TINSMITH_SESSION_TIMEOUT_S must be above 0"),
    ({"TINSMITH_CHECKPOINT_QUOTA_BYTES": "-1"}, "TINSMITH_CHECKPOINT_QUOTA_BYTES must not be negative"),
    ({"TINSMITH_GRADIENT_CHECKPOINTING": "maybe"}, "TINSMITH_GRADIENT_CHECKPOINTING must be true or false"),
    ({"TINSMITH_METRIC_HISTORY_POINTS": "1"}, "TINSMITH_METRIC_HISTORY_POINTS must be at least 2"),
    ({"TINSMITH_LOG_FORMAT": "xml"}, "TINSMITH_LOG_FORMAT must be"),
    ({"TINSMITH_RAY_PLACEMENT_STRATEGY": "scatter"}, "TINSMITH_RAY_PLACEMENT_STRATEGY must be"),
    ({"TINSMITH_DEVICE_MEMORY_FRACTION": "0"}, r"TINSMITH_DEVICE_MEMORY_FRACTION must be above 0 and at most 1 \(got 0"),
    ({"TINSMITH_DEVICE_MEMORY_FRACTION": "1.5"}, r"TINSMITH_DEVICE_MEMORY_FRACTION must be above 0 and at most 1 \(got 1.5"),
])
def test_values_that_cannot_work_are_refused_naming_the_option(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, env)


def test_serve_prints_one_line_and_exits_non_zero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", "x",
                           "--seq-gap-wait-s", "-2", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tinsmith: --seq-gap-wait-s must not be negative (got -2)"


def test_sources_rise_in_precedence_defaults_yaml_environment_flags(tmp_path):
    config = tmp_path / "tinsmith.yaml"
    config.write_text("port: 9001\nmax-lora-rank: 16\nmax_lora_adapters: 4\nbase_model: [from/yaml]\n")
    c = load_config({"config": str(config), "port": "9003"},
                    {"TINSMITH_PORT": "9002", "TINSMITH_MAX_LORA_RANK": "32"})
    assert (c.port, c.max_lora_rank, c.max_lora_adapters, c.base_model, c.max_training_runs) == \
        (9003, 32, 4, ["from/yaml"], 256)
    assert load_config(None, {"TINSMITH_CONFIG": str(config)}).port == 9001


def test_an_error_names_the_option_the_way_it_was_given(tmp_path):
    config = tmp_path / "tinsmith.yaml"
    config.write_text("max_lora_rank: 0\n")
    with pytest.raises(ConfigError, match=re.escape(f"max_lora_rank (in {config}) must be at least 1 (got 0)")):
        load_config({"config": str(config)}, {})
    with pytest.raises(ConfigError, match="^TINSMITH_MAX_LORA_RANK must be at least 1"):
        load_config({"config": str(config)}, {"TINSMITH_MAX_LORA_RANK": "-4"})
    with pytest.raises(ConfigError, match="^--max-lora-rank must be at least 1"):
        load_config({"config": str(config), "max_lora_rank": "0"}, {"TINSMITH_MAX_LORA_RANK": "8"})


@pytest.mark.parametrize("text, message", [
    ("max_lora_rnk: 8\n", "unknown option max_lora_rnk (in {}); did you mean max_lora_rank?"),
    ("- a list\n", "{}: expected a mapping of option names to values, got list"),
    ("port: [\n", "--config {}: not readable YAML ("),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, message):
    config = tmp_path / "tinsmith.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config({"config": str(config)}, {})
    assert e.value.message.startswith(message.format(config)) and "\n" not in e.value.message
    with pytest.raises(ConfigError, match="no such file"):
        load_config({"config": str(tmp_path / "missing.yaml")}, {})


def test_a_config_built_in_code_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("TINSMITH_PORT", "9999")
    assert ServerConfig().port == 8000
    with pytest.raises(ConfigError, match="^--max-runs-per-key must be at least 1 \\(got 0\\)$"):
        ServerConfig(max_runs_per_key=0)
    with pytest.raises(ConfigError, match="unknown option --no-such-option"):
        ServerConfig(no_such_option=1)


def _documented_options() -> dict[str, str]:
    """``--flag`` -> its default cell, from the options table of docs/configuration.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = text.split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)[^`]*` \| ([^|]*) \|", table, re.MULTILINE)
    return dict(rows)


def test_the_configuration_docs_list_every_option_with_its_default():
    documented = _documented_options()
    assert set(documented) == {flag_name(option) for option in ServerConfig.model_fields}
    for option, field in ServerConfig.model_fields.items():
        cell, default = documented[flag_name(option)], field.default
        if isinstance(default, bool):
            assert cell.strip() == ("on" if default else "off"), option
        elif isinstance(default, (int, float)):
            number = f"{default:g}" if isinstance(default, float) else str(default)
            mib = f"{default / (1 << 20):g} MiB" if default >= 1 << 20 else None
            assert f"`{number}`" in cell or (mib and mib in cell), (option, cell)
        elif isinstance(default, str):
            assert f"`{default}`" in cell, (option, cell)
