"""Loading real HF-format checkpoints and matching transformers' logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tinsmith.errors import InvalidInputError, NotFoundError
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model, resolve_model_dir
from tests.conftest import SMALL


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _our_logits(model, tokens):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model.logits(model.hidden_states(tokens, pos))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_logits_match_transformers(model_dirs, family):
    d = model_dirs[family]
    ours = load_model(str(d))
    assert ours.config.family == family
    assert next(ours.model.parameters()).dtype == torch.float32  # fp32 default on CPU
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (3, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
    assert _rel_err(_our_logits(ours.model, tokens), expected) < 1e-5
    assert ours.config.num_params == sum(p.numel() for p in ref.parameters())


def test_llama3_rope_scaling_is_applied(model_dirs):
    # Positions past original_max_position_embeddings (256) exercise the llama3 frequency rescaling.
    cfg = load_model(str(model_dirs["llama"])).config
    assert cfg.rope.kind == "llama3" and cfg.rope.factor == 8.0


def test_tied_embeddings(tied_qwen3_dir):
    ours = load_model(str(tied_qwen3_dir))
    assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight
    ref = transformers.AutoModelForCausalLM.from_pretrained(tied_qwen3_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.config.vocab_size, (2, 50))
    with torch.no_grad():
        assert _rel_err(_our_logits(ours.model, tokens), ref(tokens).logits) < 1e-5


def test_sharded_checkpoint(tmp_path, qwen3_dir):
    d = make_tiny_model(tmp_path / "sharded", "qwen3", SMALL, seed=1, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 1
    a, b = load_model(str(d)), load_model(str(qwen3_dir))
    tokens = torch.randint(0, 500, (1, 20))
    assert torch.equal(_our_logits(a.model, tokens), _our_logits(b.model, tokens))


def test_resolves_hub_id_from_local_hf_cache(tmp_path, monkeypatch, qwen3_dir):
    """An 'org/name' id is found in the HF cache layout (models--org--name/snapshots/<rev>)."""
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / "0123abcd"
    shutil.copytree(qwen3_dir, snap)
    (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    assert resolve_model_dir("tiny-org/tiny-qwen3") == snap
    assert load_model("tiny-org/tiny-qwen3").config.family == "qwen3"


def test_missing_model_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_dir("nobody/does-not-exist")
    with pytest.raises(NotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_unknown_architecture_names_it(tmp_path, qwen3_dir):
    d = tmp_path / "weird"
    shutil.copytree(qwen3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInputError, match="MambaForCausalLM"):
        load_model(str(d))


def test_nan_weights_rejected(tmp_path, qwen3_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan"
    shutil.copytree(qwen3_dir, d)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidInputError, match="up_proj.*NaN"):
        load_model(str(d))


def test_loading_draws_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    """A model load shows its bytes on stderr when stderr is a terminal, and nothing otherwise."""
    import sys

    from tests.conftest import SMALL
    from tinsmith.devtools.tiny_model import make_tiny_model
    from tinsmith.models.loading import load_model

    model_dir = make_tiny_model(tmp_path / "m", "qwen3", SMALL, seed=1)
    capsys.readouterr()
    load_model(str(model_dir))
    assert "loading m" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    load_model(str(model_dir))
    assert "loading m" in capsys.readouterr().err
