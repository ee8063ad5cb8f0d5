"""The last JSON-wire SDK (``tinker==0.22.2``) against the same server, in its own interpreter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, logprobs_of, lora_client, random_tokens, repeated_pattern_tokens

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SDK0222_PYTHON = REPO / ".venv-sdk-0.22.2" / "bin" / "python"
SCRIPT = Path(__file__).with_name("sdk0222_client.py")


@pytest.fixture(scope="module")
def sdk0222_python() -> Path:
    if not SDK0222_PYTHON.exists():
        pytest.skip(f"no tinker 0.22.2 interpreter at {SDK0222_PYTHON} (make the .venv-sdk-0.22.2 venv to run this)")
    return SDK0222_PYTHON


def test_sdk_0222_trains_and_matches_0_38(sdk0222_python, server, sc, base_model):
    rng = np.random.default_rng(22)
    probe = [random_tokens(rng, n + 1, VOCAB) for n in (9, 14)]
    p2_tokens = random_tokens(rng, 6, VOCAB)
    p2_targets = rng.integers(0, VOCAB, (6, 3)).tolist()
    train = repeated_pattern_tokens(seed=23, n_seqs=3, seq_len=20, vocab=VOCAB)
    args = {"base_url": server.base_url, "base_model": base_model, "probe": probe,
            "probe_2d": {"tokens": p2_tokens, "targets": p2_targets}, "train": train, "steps": 5, "lr": 5e-3}

    proc = subprocess.run([str(sdk0222_python), str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                          timeout=180, cwd=str(REPO), env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}\nserver log:\n{server.log_tail()}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["sdk_version"] == "0.22.2"
    assert out["info"] == {"model_id": out["model_id"], "model_name": base_model, "is_lora": True, "lora_rank": 4}

    # a fresh adapter through 0.38 (protobuf wire) gives the same logprobs as through 0.22.2 (JSON wire)
    tc = lora_client(sc, base_model, rank=4, seed=0)
    ref = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                  loss_fn_inputs={"target_tokens": t[1:]}) for t in probe],
                     "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    for got, want in zip(out["fresh_logprobs"], logprobs_of(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # (N, K) targets over the JSON wire: shape kept, columns equal 1-D forwards from 0.38
    assert out["logprobs_2d"]["shape"] == [6, 3]
    lp2 = np.asarray(out["logprobs_2d"]["data"]).reshape(6, 3)
    targets = np.asarray(p2_targets)
    cols = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(p2_tokens),
                                   loss_fn_inputs={"target_tokens": targets[:, j].tolist()}) for j in range(3)],
                      "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    for j, col in enumerate(logprobs_of(cols)):
        np.testing.assert_allclose(lp2[:, j], col, rtol=1e-5, atol=1e-6)

    # training through 0.22.2 works: loss falls every step, optimizer metrics arrive
    losses = out["losses"]
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(m and np.isfinite(m["grad_norm"]) for m in out["optim_metrics"]), out["optim_metrics"]
    # and it changed the adapter the probe is scored with
    assert not np.allclose(np.concatenate(out["trained_logprobs"]), np.concatenate(out["fresh_logprobs"]))
