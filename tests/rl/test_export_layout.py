"""``tinsmith export`` without a server: tied embeddings, the dtype the config declares, what
is refused, progress bars. Adapters are made directly (random LoRA weights on a tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SMALL
from tinsmith.checkpoints.export import run_export
from tinsmith.checkpoints.peft_format import save_peft_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.errors import InvalidInputError
from tinsmith.types import LoraSpec

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")]


def _adapter(model_dir: Path, out: Path, unembed: bool, rank: int = 4) -> Path:
    """A PEFT adapter with random (non-zero) A and B on every projection, and lm_head if asked."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (cfg.num_attention_heads * cfg.head_dim, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, cfg.num_attention_heads * cfg.head_dim),
              "mlp.gate_proj": (cfg.intermediate_size, h), "mlp.up_proj": (cfg.intermediate_size, h),
              "mlp.down_proj": (h, cfg.intermediate_size)}
    g = torch.Generator().manual_seed(0)
    modules = {f"model.layers.{i}.{n}": s for i in range(cfg.num_hidden_layers) for n, s in shapes.items()}
    if unembed:
        modules["lm_head"] = (cfg.vocab_size, h)
    tensors = {}
    for m, (o, i) in modules.items():
        tensors[f"{m}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.1
        tensors[f"{m}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.1
    save_peft_adapter(out, LoraSpec(rank=rank, alpha=8, train_unembed=unembed), tensors, str(model_dir))
    return out


def _logits(model_or_dir, adapter: Path | None = None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_or_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    ids = torch.arange(5, 60).reshape(1, -1) % SMALL.vocab_size
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits[0]


@pytest.mark.parametrize("unembed", [False, True])
def test_tied_embeddings_written_once(tied_qwen3_dir, tmp_path, unembed):
    adapter = _adapter(tied_qwen3_dir, tmp_path / "adapter", unembed)
    result = run_export(adapter, tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))  # fp32 config: fp32, one file
    assert all(t.dtype == torch.float32 for t in weights.values())
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert ("lm_head.weight" in weights) is unembed  # tied and not trained: only the embedding
    assert cfg["tie_word_embeddings"] is (not unembed)  # a trained unembedding unties them
    assert "model.embed_tokens.weight" in weights and result.warnings == []
    assert result.summary.startswith("merged model (float32, one model.safetensors)")
    ref = _logits(tied_qwen3_dir, adapter)
    assert torch.allclose(_logits(tmp_path / "out"), ref, atol=1e-4, rtol=1e-4)
    # sharded, the index is the one transformers writes for the same (tied or untied) model
    run_export(adapter, tmp_path / "sharded", max_shard_size="50KB")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded")).save_pretrained(
        str(tmp_path / "resaved"), max_shard_size="50KB")
    index = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    assert index == (tmp_path / "resaved" / "model.safetensors.index.json").read_text()
    assert ('"lm_head.weight"' in index) is unembed


def test_export_follows_the_config_dtype(tmp_path):
    model = make_tiny_model(tmp_path / "m16", "llama", SMALL, seed=2, dtype="float16")
    adapter = _adapter(model, tmp_path / "adapter", unembed=True)
    run_export(adapter, tmp_path / "out")
    assert {t.dtype for t in load_file(str(tmp_path / "out" / "model.safetensors")).values()} == {torch.float16}
    assert torch.allclose(_logits(tmp_path / "out"), _logits(model, adapter), atol=2e-2, rtol=2e-2)


def test_refused_before_any_work(qwen3_dir, tmp_path):
    adapter = _adapter(qwen3_dir, tmp_path / "adapter", unembed=False)
    for bad in ("abc", "-5GB", "0", "5 parsecs"):
        with pytest.raises(InvalidInputError, match="--max-shard-size"):
            run_export(adapter, tmp_path / "o1", max_shard_size=bad)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    for fmt in ("merged", "peft", "peft-vllm"):
        with pytest.raises(InvalidInputError, match="not empty"):
            run_export(adapter, tmp_path / "taken", fmt)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporaries left behind"
    with pytest.raises(InvalidInputError, match="--push-to-hub"):
        run_export(adapter, tmp_path / "o2", "peft", push_to_hub="a/b/c")


def test_vllm_adapter_of_projections_only_is_the_trained_one(qwen3_dir, tmp_path):
    adapter = _adapter(qwen3_dir, tmp_path / "adapter", unembed=False)
    result = run_export(adapter, tmp_path / "vllm", "peft-vllm")
    assert result.warnings == [] and result.summary.startswith("vLLM-servable")
    assert "and vLLM serves it" in run_export(adapter, tmp_path / "peft", "peft").summary
    assert load_file(str(tmp_path / "vllm" / "adapter_model.safetensors")).keys() == \
        load_file(str(adapter / "adapter_model.safetensors")).keys()


def test_vllm_adapter_of_unembedding_only_is_refused(qwen3_dir, tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {"lm_head.lora_A.weight": torch.randn(4, SMALL.hidden_size, generator=g),
               "lm_head.lora_B.weight": torch.randn(SMALL.vocab_size, 4, generator=g)}
    spec = LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=True)
    save_peft_adapter(tmp_path / "adapter", spec, tensors, str(qwen3_dir))
    with pytest.raises(InvalidInputError, match="--format merged"):
        run_export(tmp_path / "adapter", tmp_path / "vllm", "peft-vllm")


def test_progress_bars_on_stderr_when_wanted(qwen3_dir, tmp_path, capsys):
    adapter = _adapter(qwen3_dir, tmp_path / "adapter", unembed=False)
    run_export(adapter, tmp_path / "quiet")
    assert "merging and writing" not in capsys.readouterr().err
    run_export(adapter, tmp_path / "bars", max_shard_size="100KB", show_progress=True)
    out = capsys.readouterr()
    assert "merging and writing" in out.err and "100%" in out.err and out.out == ""


def test_push_in_offline_mode_is_a_clear_error(qwen3_dir, tmp_path, monkeypatch):
    from tinsmith.checkpoints.hub import HubError

    monkeypatch.setenv("HF_TOKEN", "hf_any")  # the test command sets HF_HUB_OFFLINE=1
    adapter = _adapter(qwen3_dir, tmp_path / "adapter", unembed=False)
    with pytest.raises(HubError, match="offline mode"):
        run_export(adapter, tmp_path / "out", "peft", push_to_hub="org/name")
    assert (tmp_path / "out" / "adapter_config.json").is_file(), "the local export stays"
