"""Every Python code block in the README and docs/ runs, unmodified, against a real server.

The server serves the tiny test model under the hub names the blocks use (``--model-alias``), and
each block runs in its own interpreter with the environment a reader would have set:
``TINKER_BASE_URL``/``TINKER_API_KEY`` for the tinker SDK, ``OPENAI_BASE_URL``/``OPENAI_API_KEY``
for the openai client. A block that cannot run here (it needs a GPU, a real hub model, ...) is
preceded by an HTML comment ``<!-- not run: why -->``, which this test reports as a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NAMES_IN_DOCS = ["Qwen/Qwen3-0.6B"]  # the model the docs train: the tiny model under that name
DEPRECATED_HERE = re.compile(r"block\.py:\d+: (FutureWarning|DeprecationWarning): .*deprecated", re.I)
BLOCK = re.compile(r"(?:<!--\s*not run:\s*(?P<why>.*?)-->\s*\n)?```python\n(?P<code>.*?)```", re.S)

pytestmark = pytest.mark.e2e


def _blocks() -> list:
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            found.append(pytest.param(m.group("code"), m.group("why"), id=f"{path.relative_to(REPO)}:{line}"))
    return found


@pytest.fixture(scope="module")
def docs_server(make_server, tiny_model):
    aliases = [arg for name in NAMES_IN_DOCS for arg in ("--model-alias", f"{name}={tiny_model}")]
    return make_server(extra_args=aliases)


def test_the_docs_have_python_blocks():
    assert _blocks(), "the block pattern no longer finds the README's training loop"


@pytest.mark.parametrize("code,why", _blocks())
def test_code_block_runs(code, why, docs_server, tiny_model, tmp_path):
    if why:
        pytest.skip(f"not run: {why.strip()}")
    for name in NAMES_IN_DOCS:  # the SDK's get_tokenizer() loads the name; a folder of that name is local
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(tiny_model)
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "TINKER_BASE_URL": docs_server.base_url, "TINKER_API_KEY": "tml-docs",
           "OPENAI_BASE_URL": docs_server.base_url + "/v1", "OPENAI_API_KEY": "tml-docs", "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}

    # A block must exit cleanly, every time: a script that ended on a sample used to die of SIGABRT
    # now and then as it exited (the SDK's pyqwest transport; the server now hands it httpx).
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\nserver log:\n{docs_server.log_tail()}"
    # The SDK warns at the caller's line when a block uses something it deprecates: the docs show
    # the current SDK's way.
    outdated = [line for line in proc.stderr.splitlines() if DEPRECATED_HERE.search(line)]
    assert not outdated, "the block uses what the SDK deprecates:\n" + "\n".join(outdated)
