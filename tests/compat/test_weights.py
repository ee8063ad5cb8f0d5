"""tinker-cookbook's ``weights`` helpers (download, merge into HF, PEFT conversion) on adapters
trained through tinsmith."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.compat


def _roundtrip(cookbook, tmp_path):
    return cookbook("weights_roundtrip.py", str(tmp_path), log_path=tmp_path, pass_log_path=False)


def _result(run) -> dict:
    return json.loads([ln for ln in run.output.splitlines() if ln.startswith("{")][-1])


def test_external_weights_download_merge_and_peft(cookbook, tmp_path):
    run = _roundtrip(cookbook, tmp_path)
    out = _result(run)
    assert "/external_weights/roundtrip" in out["path"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(out["adapter_files"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(out["peft_files"])
    # The merged HF model (plain transformers) computes what the server computed for the adapter.
    np.testing.assert_allclose(out["merged_logprobs"], out["server_logprobs"], atol=1e-4)


def test_training_checkpoint_download_is_age_encrypted(cookbook, tmp_path):
    """``weights.download`` of a ``tinker://.../weights/...`` checkpoint: the cookbook loads it into
    a new run, exports it with ``save_weights_external(age_encryption_recipients=[<fresh age key>])``,
    requires every listed file to be ``NAME.age`` and decrypts each with the identity it made
    (failing otherwise); the decrypted adapter, merged, reproduces the server's logprobs."""
    run = cookbook("weights_roundtrip.py", str(tmp_path), "--from-state", log_path=tmp_path, pass_log_path=False)
    out = _result(run)
    assert "/weights/roundtrip" in out["path"]
    assert out["listed_files"] and all(f.endswith(".age") for f in out["listed_files"])
    assert {f.removesuffix(".age") for f in out["listed_files"]} == set(out["adapter_files"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(out["adapter_files"])
    np.testing.assert_allclose(out["merged_logprobs"], out["server_logprobs"], atol=1e-4)
