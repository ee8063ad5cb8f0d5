"""Adapters leave tinsmith in standard formats: PEFT directories and merged HF models.

``save_weights_for_sampler`` and ``save_weights_external`` write PEFT adapters that
``peft.PeftModel.from_pretrained`` loads onto the ``transformers`` base model with the same
log-probabilities tinsmith computes; ``tinsmith export`` merges one into a plain HF model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (RESULT_TIMEOUT_S, gathered_logprobs, logprobs_of, lora_client,
                              repeated_pattern_batch, sft_batch)
from tests.rl.helpers import checkpoint_dir, train_steps_on

pytestmark = [pytest.mark.e2e,
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

REPO = Path(__file__).resolve().parents[2]





def _hf_base(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return m.eval()


def _peft_model(model_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(_hf_base(model_dir), str(adapter_dir)).eval()


def _assert_close(ours: list[np.ndarray], ref: list[np.ndarray], rel: float = 1e-4) -> None:
    for a, b in zip(ours, ref):
        err = np.abs(a - b) / np.maximum(np.abs(b), 1e-3)
        assert float(err.max()) < rel, (float(err.max()), a[:5], b[:5])


@pytest.fixture(scope="module")
def trained(server, base_model):
    """A LoRA run trained a few steps (so its adapter is far from zero), with its checkpoints."""
    import tinker

    sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-rl-peft")
    tc = lora_client(sc, base_model, rank=8, seed=13)
    train_steps_on(tc, repeated_pattern_batch(seed=2, n_seqs=3, seq_len=24, vocab=VOCAB), 4, 1e-2)
    sampler_path = tc.save_weights_for_sampler("x").result(timeout=RESULT_TIMEOUT_S).path
    external_path = tc.save_weights_external("e").result(timeout=RESULT_TIMEOUT_S).path
    state_path = tc.save_state("st").result(timeout=RESULT_TIMEOUT_S).path
    data = sft_batch(seed=77, n_seqs=3, seq_len=18, vocab=VOCAB)
    ours = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    yield {"tc": tc, "data": data, "ours": ours, "sampler": sampler_path, "external": external_path,
           "state": state_path}
    sc.close("success").result(timeout=60)


def test_paths_and_peft_layout(trained, server):
    run = trained["tc"].model_id
    assert trained["sampler"] == f"tinker://{run}/sampler_weights/x"
    assert trained["external"] == f"tinker://{run}/external_weights/e"
    for key in ("sampler", "external", "state"):
        d = checkpoint_dir(server, trained[key])
        assert (d / "adapter_config.json").is_file() and (d / "adapter_model.safetensors").is_file(), key
        assert not [p for p in d.parent.iterdir() if p.name.startswith(".")], "temporary dirs left behind"


@pytest.mark.parametrize("key", ["sampler", "external", "state"])
def test_peft_loads_with_tinsmith_logprobs(trained, server, tiny_model, key):
    model = _peft_model(tiny_model, checkpoint_dir(server, trained[key]))
    ref = gathered_logprobs(model, trained["data"])
    _assert_close(trained["ours"], ref)
    # control: the adapter matters (the base model alone is clearly different)
    base_only = gathered_logprobs(_hf_base(tiny_model), trained["data"])
    assert max(float(np.abs(a - b).max()) for a, b in zip(trained["ours"], base_only)) > 1e-2


def _export_subprocess(*args: str) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tinsmith.cli", "export", *args], cwd=str(REPO),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _export(capsys, *args: str) -> tuple[int, str, str]:
    """The same entry point in this process (no second torch import): exit code, stdout, stderr."""
    from tinsmith.cli import main

    code = main(["export", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tinsmith_export_merges_into_plain_hf_model(trained, server, tiny_model, tmp_path, capsys):
    peft_ref = gathered_logprobs(_peft_model(tiny_model, checkpoint_dir(server, trained["external"])),
                                  trained["data"])
    # from a checkpoint directory (PEFT layout), through the installed command line
    r = _export_subprocess(str(checkpoint_dir(server, trained["external"])), "--out", str(tmp_path / "from-dir"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(tmp_path / "from-dir")
    merged = gathered_logprobs(_hf_base(tmp_path / "from-dir"), trained["data"])
    _assert_close(merged, peft_ref)
    _assert_close(merged, trained["ours"])
    # from a tinker:// path of the server's data dir (the training-state checkpoint)
    code, _, err = _export(capsys, trained["state"], "--out", str(tmp_path / "from-path"),
                           "--data-dir", str(server.data_dir))
    assert code == 0, err
    merged2 = gathered_logprobs(_hf_base(tmp_path / "from-path"), trained["data"])
    _assert_close(merged2, peft_ref)
    # the merged model is a plain HF directory: config, weights, tokenizer
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "from-path" / f).is_file(), f


def test_tinsmith_export_errors_are_clean(server, tmp_path, capsys):
    code, _, err = _export(capsys, "tinker://no-such-run/weights/x", "--out", str(tmp_path / "o"),
                           "--data-dir", str(server.data_dir))
    assert code == 1 and "no checkpoint tinker://no-such-run/weights/x" in err, err
    code, _, err = _export(capsys, str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 1 and "no LoRA checkpoint" in err, err
    code, _, err = _export(capsys, "tinker://bad-path", "--out", str(tmp_path / "o"),
                           "--data-dir", str(server.data_dir))
    assert code == 1 and "tinker://bad-path" in err, err
