"""Random-weight checkpoints with the real shapes of the Qwen3 releases, written locally (no downloads).

Weights are drawn with transformers' own initialiser (std 0.02, so activations stay finite through
36 layers) on the benchmark's device and stored in bf16, as the releases are. A cache directory
keeps them between runs: making an 8B checkpoint costs a minute, loading it seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tinsmith.devtools.tiny_model import SPECIAL_TOKENS, train_bpe_tokenizer

QWEN3_VOCAB = 151_936

# name -> (hidden, intermediate, layers, heads, kv heads, tied embeddings); head_dim 128 throughout.
SHAPES: dict[str, dict] = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # the real vocabulary on a toy body: runs every part on a CPU in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def qwen3_config(name: str):
    import transformers

    s = SHAPES[name]
    return transformers.Qwen3Config(vocab_size=QWEN3_VOCAB, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                                    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=3,
                                    dtype="bfloat16", **s)


def _write_tokenizer(out: Path) -> None:
    """A small BPE tokenizer (ids beyond it are valid model tokens; they decode to nothing)."""
    import transformers

    tok = train_bpe_tokenizer(2048, seed=0)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0],
                                                pad_token="<|pad|>")
    fast.save_pretrained(out)


def checkpoint(name: str, cache_dir: Path, device: str) -> Path:
    """The checkpoint directory of shape ``name`` under ``cache_dir``, made on ``device`` if missing."""
    import transformers

    out = Path(cache_dir) / f"qwen3-{name}-random"
    done = out / "tinsmith_bench_shape.json"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = qwen3_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    _write_tokenizer(out)
    done.write_text(json.dumps({"shape": name, **SHAPES[name]}))
    return out


def param_counts(config) -> dict[str, int]:
    """N for the MFU conventions: every weight matrix a token passes through (the unembedding
    counted once even when tied), and the non-embedding part a decode step streams besides it."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    unembed = config.vocab_size * h
    return {"layers": L * per_layer, "unembed": unembed, "matmul": L * per_layer + unembed}
