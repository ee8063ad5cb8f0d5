"""One small SFT + sampling + checkpoint script (``scripts/sdk_smoke.py``) through several tinker SDK
versions, each in its own cached venv, against one server.

0.22.2 is the last SDK that speaks JSON for forward_backward and sample; 0.22.3 is the first that
speaks protobuf; the others sample the releases since. 0.38.0 is ``.venv``'s own SDK.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from tests.compat.venvs import REPO, VenvUnavailable, ensure_venv, sdk_spec
from tests.conftest import SMALL
from tests.e2e.server import ServerProcess
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = pytest.mark.compat

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sdk_smoke.py"
SDK_VERSIONS = ["0.22.2", "0.22.3", "0.26.2", "0.30.4", "0.34.0", "0.38.0"]
PATTERN = [17, 101, 33, 250, 7, 64, 199, 42]  # as in sdk_smoke.py


def _sdk_python(version: str) -> Path | str | Exception:
    """The interpreter for one SDK version, why there is none (no registry), or the build error."""
    if version == metadata.version("tinker"):
        return Path(sys.executable)
    if version == "0.22.2" and (REPO / ".venv-sdk-0.22.2" / "bin" / "python").exists():  # made by scripts/setup
        return REPO / ".venv-sdk-0.22.2" / "bin" / "python"
    try:
        return ensure_venv(sdk_spec(version))
    except VenvUnavailable as e:
        return f"tinker {version} venv unavailable: {e}"
    except Exception as e:  # noqa: BLE001 - reported by that version's test, not by the fixture
        return e


@pytest.fixture(scope="module")
def sdk_pythons() -> dict[str, Path | str | Exception]:
    """Every version's venv, the missing ones built side by side (each build is mostly waiting on pip)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(SDK_VERSIONS, pool.map(_sdk_python, SDK_VERSIONS)))


@pytest.fixture(scope="module")
def matrix_server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("sdk-matrix-model") / "qwen3", "qwen3", SMALL, seed=1)
    srv = ServerProcess(model, tmp_path_factory.mktemp("sdk-matrix-data"), extra_args=["--device", "cpu"])
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("version", SDK_VERSIONS)
def test_sdk_version_trains_samples_and_checkpoints(version, sdk_pythons, matrix_server):
    python = sdk_pythons[version]
    if isinstance(python, str):
        pytest.skip(python)
    if isinstance(python, Exception):
        pytest.fail(f"could not build the tinker {version} venv: {python}")
    proc = subprocess.run([str(python), str(SCRIPT), matrix_server.base_url, matrix_server.base_model],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO),
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0",
                               "PYTHONFAULTHANDLER": "1"})  # a crash prints every thread's stack
    assert proc.returncode == 0, (f"rc {proc.returncode}\nstdout:\n{proc.stdout[-1500:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}\nserver log:\n{matrix_server.log_tail()}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sdk_version"] == version

    # forward_backward: one logprob per target, finite; cross_entropy + Adam learns the cycle
    losses = out["losses"]
    assert out["shapes"] == [19, 19, 19, 19]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 4.0 and losses[-1] < 1.0, losses
    # sampling: num_samples sequences of max_tokens tokens with one float logprob each
    assert len(out["samples"]) == 2
    for s in out["samples"]:
        assert len(s["tokens"]) == 6 and s["stop_reason"] == "length"
        assert len(s["logprobs"]) == 6 and all(lp <= 0 for lp in s["logprobs"])
    # temperature 0 is greedy: deterministic, and after training it continues the cycle
    g1, g2 = out["greedy"]
    assert g1 == g2
    # Counted as transitions, not positions: one early slip shifts every later position of an
    # otherwise learned continuation, which a positional comparison would count as all wrong.
    follows = {a: b for a, b in zip(PATTERN, PATTERN[1:] + PATTERN[:1])}
    chain = [PATTERN[3]] + g1
    assert sum(follows.get(a) == b for a, b in zip(chain, chain[1:])) >= 6, (g1, PATTERN)
    # the sampler holds the trained weights: its prompt logprobs equal the trainer's forward
    fwd = np.asarray(out["forward_logprobs"][0])
    prompt_lp = out["sampler_prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == 20
    np.testing.assert_allclose(np.asarray(prompt_lp[1:], dtype=float), fwd, atol=2e-4)
    # checkpoints: tinker:// paths that reload to the same weights, as training and as sampler
    state_path, sampler_path = out["paths"]
    assert state_path.startswith("tinker://") and "/weights/sdk-smoke" in state_path
    assert sampler_path.startswith("tinker://") and "/sampler_weights/sdk-smoke-sampler" in sampler_path
    np.testing.assert_allclose(np.asarray(out["loaded_forward_logprobs"]), np.asarray(out["forward_logprobs"]),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["loaded_sampler_prompt_logprobs"][1:], dtype=float), fwd, atol=2e-4)
