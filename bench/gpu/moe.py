"""A Qwen3-30B-A3B-sized mixture of experts against the dense model of equal active parameters.

Both are a few layers of the release's shape (hidden 2048, 32 query / 4 key-value heads of 128,
128 experts of width 768 with 8 routed per token); the dense twin's MLP is 8 x 768 = 6144 wide,
so each token passes the same number of weights in both. The ratio of their LoRA fwd+bwd and
decode tokens/s is the cost of routing (sorting tokens by expert, the grouped matmuls and their
LoRA), which is what the mixture-of-experts path has to keep small.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.gpu.sample import run_sampler
from bench.gpu.shapes import QWEN3_VOCAB, _write_tokenizer
from bench.gpu.train import RANK, batch, mfu, step_rate
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler
from tinsmith.types import LoraSpec
from tinsmith.worker.runtime import TrainingRuntime

ATTENTION = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 768
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _configs(layers: int, quick: bool):
    import transformers

    attn = TINY if quick else ATTENTION
    experts, top_k, width = (8, 2, 32) if quick else (EXPERTS, TOP_K, EXPERT_WIDTH)
    common = dict(vocab_size=QWEN3_VOCAB, num_hidden_layers=layers, max_position_embeddings=40_960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=3,
                  tie_word_embeddings=False, dtype="bfloat16", **attn)
    moe = transformers.Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                                      intermediate_size=top_k * width, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[], **common)
    dense = transformers.Qwen3Config(intermediate_size=top_k * width, **common)
    return {"moe": moe, "dense": dense}


def _checkpoint(kind: str, config, cache_dir: Path, device: str) -> Path:
    import transformers

    out = Path(cache_dir) / f"qwen3-a3b-{kind}-{config.num_hidden_layers}L-{config.hidden_size}"
    done = out / "tinsmith_bench_shape.json"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    _write_tokenizer(out)
    done.write_text(json.dumps({"kind": kind, "layers": config.num_hidden_layers}))
    return out


def active_params(config) -> int:
    """Weights each token passes through (attention, the routed or dense MLP, unembedding)."""
    h, L = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    width = getattr(config, "num_experts_per_tok", 1) * getattr(config, "moe_intermediate_size", 0) \
        or config.intermediate_size
    return L * (h * (q + 2 * kv) + q * h + 3 * h * width) + config.vocab_size * h


def moe_vs_dense(cache_dir: Path, device: torch.device, peak: dict, quick: bool, layers: int = 4) -> dict:
    """LoRA r32 fwd+bwd (8 x 1024) and 64-row decode tokens/s of both, and their ratios."""
    rows, length = (2, 32) if quick else (8, 1024)
    decode_rows, prompt, new = (4, 8, 8) if quick else (64, 128, 128)
    out: dict = {"layers": layers, "train_shape": f"{rows}x{length}", "decode_rows": decode_rows}
    for kind, config in _configs(layers, quick).items():
        lm = load_model(str(_checkpoint(kind, config, cache_dir, str(device))), device=device)
        rt = TrainingRuntime(lm.model, max_lora_adapters=1, max_lora_rank=RANK)
        unit = rt.create_adapter(LoraSpec(rank=RANK, seed=0))
        r = step_rate(rt, {unit: batch(lm.config.vocab_size, rows, length)}, 2 if quick else 4)
        n = active_params(config)
        sampler = Sampler(lm.model, lambda toks: "", max_rows=decode_rows)
        run_sampler(sampler, 2, prompt, 4, [None], seed=99)  # warm-up
        s = run_sampler(sampler, decode_rows, prompt, new, [None], seed=1)
        out[kind] = {"active_params": n, "train_tokens_per_s": r["tokens_per_s"],
                     "train_mfu_4nt": mfu(r["tokens_per_s"], n, 4, peak["matmul_flops_per_s"]),
                     "decode_tokens_per_s": decode_rows * new / s, "peak_gib": r["peak_gib"]}
        del sampler, rt, lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["train_moe_vs_dense"] = out["moe"]["train_tokens_per_s"] / out["dense"]["train_tokens_per_s"]
    out["decode_moe_vs_dense"] = out["moe"]["decode_tokens_per_s"] / out["dense"]["decode_tokens_per_s"]
    return out
