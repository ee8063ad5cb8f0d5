"""The ``tinsmith`` command line as a newcomer meets it: run as a real process, as a user would.

Every start-up mistake is one line on stderr with a non-zero exit, found before anything slow:
nothing is written to the data dir and no model is loaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.server.config import ServerConfig, env_name, flag_name
from tinsmith.server.startup import StartupError, bind_listening_socket
from tests.conftest import SMALL

REPO = Path(__file__).resolve().parents[1]


def tinsmith(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m tinsmith ARGS`` from the repository, with only the given TINSMITH_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TINSMITH_")}
    return subprocess.run([sys.executable, "-m", "tinsmith", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**base, "HF_HUB_OFFLINE": "1", **(env or {})})


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli") / "qwen3", "qwen3", SMALL, seed=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port():
    """A port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_version_prints_the_package_version():
    proc = tinsmith("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tinsmith {importlib.metadata.version('tinsmith')}"


def test_the_installed_entry_point_runs_the_same_command_line():
    script = Path(sys.executable).parent / "tinsmith"
    if not script.exists():
        pytest.skip("no tinsmith script next to this interpreter (package not installed)")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tinsmith ")


@pytest.mark.parametrize("command", [[], ["serve"], ["export"], ["make-tiny-model"], ["demo"]])
def test_every_help_works(command):
    proc = tinsmith(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"usage: tinsmith" + "".join(f" {c}" for c in command), proc.stdout, re.IGNORECASE)


def test_bare_tinsmith_lists_the_commands():
    proc = tinsmith()
    assert proc.returncode != 0
    for command in ("serve", "export", "make-tiny-model", "demo"):
        assert command in proc.stderr


def test_serve_help_names_every_option_with_its_environment_variable_and_default():
    text = " ".join(tinsmith("serve", "--help").stdout.split())  # undo the line wrapping
    for option in ServerConfig.model_fields:
        assert flag_name(option) in text
        assert f"env {env_name(option)}" in text, option
    assert "--max-lora-rank INT largest LoRA rank a client may ask for [env TINSMITH_MAX_LORA_RANK; default: 128]" in text
    assert "[env TINSMITH_SESSION_TIMEOUT_S; default: 300]" in text
    assert "[env TINSMITH_GRADIENT_CHECKPOINTING; default: off]" in text
    assert "[env TINSMITH_CONFIG]" in text


@pytest.mark.parametrize("args, env, expected", [
    (["--port", "eighty"], {}, "tinsmith: --port must be an integer (got 'eighty')"),
    (["--port", "0"], {}, "tinsmith: --port must be between 1 and 65535 (got 0)"),
    ([], {"TINSMITH_PORT": "70000"}, "tinsmith: TINSMITH_PORT must be between 1 and 65535 (got 70000)"),
    (["--max-lora-rank", "0"], {"TINSMITH_MAX_LORA_RANK": "8"}, "tinsmith: --max-lora-rank must be at least 1 (got 0)"),
    (["--log-level", "loud"], {}, "--log-level must be 'debug', 'info', 'warning' or 'error' (got 'loud')"),
    (["--max-lora-rnk", "8"], {}, "No such option '--max-lora-rnk'"),
    (["--model-alias", "just-a-name"], {}, "--model-alias 'just-a-name' must look like NAME=ID_OR_DIR"),
    ([], {}, "tinsmith: no base model: pass --base-model ID_OR_DIR (or set TINSMITH_BASE_MODEL)"),
])
def test_option_mistakes_are_one_line(tmp_path, args, env, expected):
    if "no base model" not in expected:
        args = [*args, "--base-model", str(tmp_path)]
    proc = tinsmith("serve", "--data-dir", str(tmp_path / "data"), *args, env=env)
    assert proc.returncode == 2
    assert expected in one_line(proc)
    assert not (tmp_path / "data").exists()


def test_an_unknown_yaml_key_is_one_line_with_a_suggestion(tmp_path):
    config = tmp_path / "tinsmith.yaml"
    config.write_text("base_model: [x/y]\nmax_lora_rnk: 8\n")
    proc = tinsmith("serve", "--config", str(config))
    assert proc.returncode == 2
    assert one_line(proc) == f"tinsmith: unknown option max_lora_rnk (in {config}); did you mean max_lora_rank?"


@pytest.mark.parametrize("make, expected", [
    (lambda p: None, "no such directory"),
    (lambda p: p.write_text("weights?"), "a file, not a model directory"),
    (lambda p: p.mkdir(), "the directory has no config.json"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{not json")), "cannot read"),
])
def test_a_local_model_that_cannot_be_one_is_one_line(tmp_path, make, expected):
    make(tmp_path / "model")
    proc = tinsmith("serve", "--base-model", str(tmp_path / "model"), "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2
    assert one_line(proc).startswith(f"tinsmith: --base-model {tmp_path / 'model'}: {expected}")
    assert not (tmp_path / "data").exists()


def test_a_hub_id_not_in_the_cache_while_offline_is_one_line(tmp_path):
    proc = tinsmith("serve", "--base-model", "Qwen/Qwen3-Nonexistent-7B", "--data-dir", str(tmp_path / "data"),
                    env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2
    line = one_line(proc)
    assert "Qwen/Qwen3-Nonexistent-7B" in line and "HF_HUB_OFFLINE" in line
    assert not (tmp_path / "data").exists()


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    proc = tinsmith("serve", "--base-model", str(model), "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2
    line = one_line(proc)
    assert "GPT2LMHeadModel" in line and "Qwen3ForCausalLM" in line
    assert not (tmp_path / "data").exists()


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path, tiny_model, busy_port):
    started = time.monotonic()
    proc = tinsmith("serve", "--base-model", str(tiny_model), "--port", str(busy_port),
                    "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2
    assert one_line(proc).startswith(f"tinsmith: --port {busy_port} is in use on 127.0.0.1; pick another with "
                                     "--port or TINSMITH_PORT")
    assert not (tmp_path / "data").exists()  # no database, no lock: nothing slow was started
    assert time.monotonic() - started < 30


def test_ray_without_tensor_parallelism_is_one_line(tmp_path, tiny_model):
    proc = tinsmith("serve", "--base-model", str(tiny_model), "--port", str(free_port()), "--ray-address", "auto",
                    "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2
    assert one_line(proc) == ("tinsmith: --ray-address auto places the ranks of a tensor- or data-parallel group, "
                              "but --tensor-parallel-size and --data-parallel-size are 1 (one rank, in this process); "
                              "pass --tensor-parallel-size N or --data-parallel-size M (> 1) or drop --ray-address")
    assert not (tmp_path / "data").exists()


def test_a_port_held_by_a_starting_server_is_refused_to_a_second():
    first = bind_listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(StartupError, match="is in use"):
            bind_listening_socket("127.0.0.1", first.getsockname()[1]).close()
    finally:
        first.close()


def test_a_model_that_fails_to_load_is_one_line_and_debug_shows_the_traceback(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\0" * 100)  # config fine, weights unreadable
    proc = tinsmith("serve", "--base-model", str(broken), "--data-dir", str(tmp_path / "data"), "--port", str(free_port()),
                    env={"TINSMITH_LOG_LEVEL": "warning"})
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tinsmith: cannot load base model {broken}: ")
    assert line.endswith("run with --log-level debug for the full traceback")
    assert "Traceback" not in proc.stderr

    debug = tinsmith("serve", "--base-model", str(broken), "--data-dir", str(tmp_path / "data"), "--port", str(free_port()),
                     "--log-level", "debug")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith(f"tinsmith: cannot load base model {broken}: ")
