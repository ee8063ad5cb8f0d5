"""``tinsmith export`` writes what other tools load: a merged model in the base model's dtype,
sharded with an index exactly as ``transformers`` writes it; a PEFT adapter, and one vLLM can
serve (no unembedding); and pushes any of them to a Hugging Face Hub (a local fake here).

The base model here declares bfloat16, as Qwen3 releases do; the server trains on it (in fp32
on CPU), and the merged bf16 export must give its log-probabilities within bf16 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SMALL
from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, gathered_logprobs, logprobs_of, lora_client, sft_batch
from tests.e2e.server import ServerProcess
from tests.rl.fake_hub import USER, FakeHub
from tests.rl.helpers import checkpoint_dir, train_steps_on
from tinsmith.devtools.tiny_model import make_tiny_model

pytestmark = [pytest.mark.e2e,
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

REPO = Path(__file__).resolve().parents[2]
SHARD = "100KB"  # small enough that the tiny model needs several shards
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "qwen3", "qwen3", SMALL, seed=4, dtype="bfloat16")


@pytest.fixture(scope="module")
def trained(bf16_model, tmp_path_factory):
    """A LoRA run (unembedding included, the SDK's default) trained on the bf16 model."""
    import tinker

    server = ServerProcess(bf16_model, tmp_path_factory.mktemp("bf16-data")).start()
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-hf-exports")
        tc = lora_client(sc, str(bf16_model), rank=8, seed=5)
        train_steps_on(tc, sft_batch(seed=3, n_seqs=3, seq_len=24, vocab=VOCAB), 4, 2e-2)
        state = tc.save_state("st").result(timeout=RESULT_TIMEOUT_S).path
        data = sft_batch(seed=78, n_seqs=3, seq_len=18, vocab=VOCAB)
        ours = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
        yield {"server": server, "state": state, "dir": checkpoint_dir(server, state), "data": data, "ours": ours}
        sc.close("success").result(timeout=60)
    finally:
        server.stop()


def _export(capsys, *args: str) -> tuple[int, str, str]:
    from tinsmith.cli import main

    code = main(["export", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _hf(model_dir, dtype="auto"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def _peft(base_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(_hf(base_dir, torch.float32), str(adapter_dir)).eval()


def _max_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_merged_export_is_bf16_sharded_like_transformers(trained, bf16_model, tmp_path, capsys):
    out = tmp_path / "merged"
    code, stdout, err = _export(capsys, trained["state"], "--out", str(out), "--data-dir",
                                str(trained["server"].data_dir), "--max-shard-size", SHARD)
    assert code == 0, err
    assert stdout.strip() == str(out)
    assert "%|" not in err, "no progress bars when stderr is not a terminal"
    assert "merged model (bfloat16, " in err and "shards with an index" in err, err
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    for shard in shards:
        assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / shard)).values()), shard

    model = _hf(out)  # dtype="auto": what the config declares
    assert model.dtype == torch.bfloat16
    # the layout is the one transformers writes for the same model and shard size, byte for byte
    again = tmp_path / "resaved"
    model.save_pretrained(str(again), max_shard_size=SHARD)
    assert (again / "model.safetensors.index.json").read_text() == (out / "model.safetensors.index.json").read_text()
    for shard in shards:
        ours, theirs = load_file(str(out / shard)), load_file(str(again / shard))
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), shard

    # the merged bf16 model gives the server's log-probabilities within bf16 rounding...
    merged = gathered_logprobs(model, trained["data"])
    err_merged = _max_abs(merged, trained["ours"])
    assert err_merged < 0.05, err_merged
    # ...and the training mattered far more than that (the base model alone is clearly elsewhere)
    base_only = gathered_logprobs(_hf(bf16_model), trained["data"])
    assert _max_abs(base_only, trained["ours"]) > 5 * err_merged


def test_peft_and_vllm_adapters(trained, bf16_model, tmp_path, capsys):
    # the PEFT adapter as trained: lm_head included, the server's log-probabilities in peft
    code, _, err = _export(capsys, str(trained["dir"]), "--out", str(tmp_path / "peft"), "--format", "peft")
    assert code == 0 and "warning" not in err, err
    assert "PEFT adapter as trained" in err and "vLLM refuses its lm_head" in err, err
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert "lm_head" in cfg["target_modules"]
    full = gathered_logprobs(_peft(bf16_model, tmp_path / "peft"), trained["data"])
    assert _max_abs(full, trained["ours"]) < 1e-3

    # the vLLM adapter: projections only, a warning that it is not the trained model
    vdir = tmp_path / "vllm"
    code, stdout, err = _export(capsys, str(trained["dir"]), "--out", str(vdir), "--format", "peft-vllm")
    assert code == 0 and stdout.strip() == str(vdir), err
    assert "warning" in err and "lm_head" in err and "NOT the trained model" in err, err
    assert "vLLM-servable PEFT adapter" in err, err
    cfg = json.loads((vdir / "adapter_config.json").read_text())
    assert cfg["target_modules"] == PROJECTIONS and not cfg.get("modules_to_save")
    keys = list(load_file(str(vdir / "adapter_model.safetensors")))
    assert keys and not [k for k in keys if "lm_head" in k or "embed" in k], keys
    assert {k.split(".")[-3] for k in keys} == set(PROJECTIONS)
    model = _peft(bf16_model, vdir)
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert adapted == set(PROJECTIONS), adapted
    vllm = gathered_logprobs(model, trained["data"])
    assert _max_abs(vllm, trained["ours"]) > 1e-3, "dropping the trained lm_head LoRA must show"
    readme = (vdir / "README.md").read_text()
    assert "peft-vllm" in readme and "vllm serve" in readme and "Warning" in readme


def _push(adapter_dir: Path, out: Path, repo: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it, with the Hub found through the environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_"))}
    return subprocess.run([sys.executable, "-m", "tinsmith.cli", "export", str(adapter_dir), "--out", str(out),
                           "--format", "peft", "--push-to-hub", repo],
                          cwd=str(REPO), capture_output=True, text=True, timeout=300,
                          env={**clean, "HF_HOME": str(out.parent / "hf-home"), **env})


def test_push_to_hub_round_trip(trained, bf16_model, tmp_path):
    with FakeHub(token="hf_test_token") as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_test_token"}
        r = _push(trained["dir"], tmp_path / "a", "my-adapter", env)
        assert r.returncode == 0, r.stderr[-3000:]
        repo = hub.repos[f"{USER}/my-adapter"]  # no org given: the token's account
        assert repo.commits == ["Upload tinsmith export"]
        local = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
        assert repo.files == local
        assert hub.cards and "library_name: peft" in hub.cards[0]
        # what the hub received loads in peft and is the trained model
        fetched = tmp_path / "fetched"
        fetched.mkdir()
        for name, data in repo.files.items():
            (fetched / name).write_bytes(data)
        lp = gathered_logprobs(_peft(bf16_model, fetched), trained["data"])
        assert _max_abs(lp, trained["ours"]) < 1e-3

        # a wrong token: a clear error naming the Hub's answer, exit 1, nothing created
        r = _push(trained["dir"], tmp_path / "b", "org/other", {**env, "HF_TOKEN": "hf_wrong"})
        assert r.returncode == 1 and "401" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        # no token at all: refused before any request
        n = len(hub.requests)
        r = _push(trained["dir"], tmp_path / "c", "org/other", {"HF_ENDPOINT": hub.endpoint})
        assert r.returncode == 1 and "HF_TOKEN" in r.stderr, r.stderr[-3000:]
        assert len(hub.requests) == n and list(hub.repos) == [f"{USER}/my-adapter"]
