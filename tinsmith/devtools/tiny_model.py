"""Make tiny, random-initialised Hugging Face checkpoints with an offline-trained BPE tokenizer.

Tests, benchmarks and the demo need real HF-format model directories (``config.json``,
safetensors, ``tokenizer.json``) but nothing may be downloaded. This module builds them with
``transformers`` itself, so the loading code under test reads exactly what it would read from
the hub, and the transformers model class doubles as the numerical reference.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# Optional extras (``extra_special_tokens=``) for chat renderers that assert single special tokens:
# the Qwen3 / Qwen3.5 chat format and the Llama 3 header tokens.
QWEN_CHAT_SPECIAL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                            "</tool_response>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

_WORDS = (
    "the a an and or but if then else when while for to of in on at by with from up down over "
    "under again further once here there all any both each few more most other some such no nor "
    "not only own same so than too very can will just don should now user assistant system answer "
    "question what is number sum plus minus times equals zero one two three four five six seven "
    "eight nine ten hello world model train sample loss reward step learn good bad yes think "
    "because right wrong letter word sentence story about small large fast slow red blue green"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    """A deterministic mixed corpus: words, digits, arithmetic and chat-style markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            lines.append(f"{a} + {b} = {a + b}")
        elif kind == 2:
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
            lines.append(f"User: {q}?\n\nAssistant: {q}.")
        else:
            lines.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ,.:;!?-()\n") for _ in range(40)))
    return lines


def train_bpe_tokenizer(vocab_size: int, seed: int = 0, extra_special_tokens: tuple[str, ...] = ()):
    """Train a byte-level BPE tokenizer on the built-in corpus (no network).

    ``extra_special_tokens`` are added after the default ones (ids 0-3 are unchanged).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    return tok


@dataclass(frozen=True)
class TinyShape:
    """Dimensions of a tiny model. The default is a ~4.2M-parameter Qwen3."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Mixture of experts (qwen3_moe, gpt_oss): every layer routes each token to top-k of the experts
    # (gpt_oss: moe_intermediate_size is its intermediate_size).
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    # gpt_oss only: the window of its sliding-attention layers (every other layer, as gpt-oss).
    sliding_window: int = 16
    # qwen3_5 / qwen3_5_moe: Gated DeltaNet layers, with full attention on every
    # ``full_attention_interval``-th layer (as the releases: 4).
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    full_attention_interval: int = 2


FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe", "qwen3_vl", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl",
            "qwen3_5_moe_vl")
# Image-text checkpoints (a vision tower, an image processor, the vision special tokens): Qwen3-VL,
# and Qwen3.5 / Qwen3.5-MoE as released (``Qwen3_5ForConditionalGeneration``: the ``_vl`` names).
IMAGE_TEXT = ("qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl")

# The vision-language family: its tokenizer needs these specials, and images stay small.
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_IMAGE_MIN_PIXELS = 32 * 32
TINY_IMAGE_MAX_PIXELS = 128 * 128

# A minimal harmony-style chat template for the tiny gpt_oss tokenizer (the real one needs
# harmony's special tokens, which the tiny tokenizer carries as GPT_OSS_SPECIAL_TOKENS).
GPT_OSS_SPECIAL_TOKENS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>")
_HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}"
    "{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def _hf_config(family: str, shape: TinyShape, tokenizer_vocab: int, eos_id: int, pad_id: int, tok=None):
    import transformers

    common = dict(
        vocab_size=max(shape.vocab_size, tokenizer_vocab),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=shape.head_dim, rope_theta=1_000_000.0, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            head_dim=shape.head_dim, rope_theta=1_000_000.0, num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok, moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
    if family == "gpt_oss":
        # YaRN as gpt-oss releases (factor 32 over 4096 there), scaled down so tiny tests reach it.
        original = max(shape.max_position_embeddings // 4, 1)
        return transformers.GptOssConfig(
            head_dim=shape.head_dim, num_local_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
            sliding_window=shape.sliding_window, attention_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": original},
            **{**common, "intermediate_size": shape.moe_intermediate_size},
        )
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"):
        hybrid = dict(
            common, head_dim=shape.head_dim, linear_conv_kernel_dim=4,
            linear_num_key_heads=shape.linear_num_key_heads, linear_num_value_heads=shape.linear_num_value_heads,
            linear_key_head_dim=shape.linear_key_head_dim, linear_value_head_dim=shape.linear_value_head_dim,
            layer_types=["full_attention" if (i + 1) % shape.full_attention_interval == 0 else "linear_attention"
                         for i in range(shape.num_hidden_layers)],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25})
        if family.startswith("qwen3_5_moe"):
            hybrid.pop("intermediate_size")
            hybrid.update(num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                          moe_intermediate_size=shape.moe_intermediate_size,
                          shared_expert_intermediate_size=shape.moe_intermediate_size)
        if family == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**hybrid)
        if family == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**hybrid)
        # As released: the text config nested, the rotary's multimodal sections left to the
        # class's default, a vision tower without DeepStack.
        hybrid.pop("tie_word_embeddings")
        config_cls = transformers.Qwen3_5MoeConfig if family == "qwen3_5_moe_vl" else transformers.Qwen3_5Config
        return config_cls(text_config=hybrid, vision_config=_tiny_vision(shape), tie_word_embeddings=shape.tie_word_embeddings,
                          **_vision_token_ids(tok))
    if family == "qwen2":
        return transformers.Qwen2Config(rope_theta=1_000_000.0, **common)
    if family == "llama":
        return transformers.LlamaConfig(
            head_dim=shape.head_dim,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            **common,
        )
    if family == "qwen3_vl":
        half = shape.head_dim // 2  # rotary frequencies, split temporal/height/width like 24/20/20 of 64
        section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
        text = dict(common, head_dim=shape.head_dim,
                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section,
                                     "mrope_interleaved": True})
        text.pop("tie_word_embeddings")
        vision = dict(_tiny_vision(shape), deepstack_visual_indexes=[0, 1])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision,
                                          tie_word_embeddings=shape.tie_word_embeddings, **_vision_token_ids(tok))
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def _tiny_vision(shape: TinyShape) -> dict:
    """A two-block vision tower's config, its output the decoder's width."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=shape.hidden_size, num_position_embeddings=64)


def _vision_token_ids(tok) -> dict[str, int]:
    """An image-text config's special token ids, as the tiny tokenizer numbers them."""
    return {name: tok.token_to_id(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def make_tiny_model(
    out_dir: str | Path,
    family: str = "qwen3",
    shape: TinyShape = TinyShape(),
    seed: int = 0,
    max_shard_size: str | None = None,
    extra_special_tokens: tuple[str, ...] = (),
    dtype: str = "float32",
) -> Path:
    """Write a random-initialised HF checkpoint plus tokenizer to ``out_dir`` and return it.

    ``max_shard_size`` (e.g. ``"200KB"``) writes a sharded checkpoint with an index file.
    ``extra_special_tokens`` (e.g. ``QWEN_CHAT_SPECIAL_TOKENS``) become single special tokens of
    the tokenizer, after the default ones; the model's vocabulary covers them.
    ``dtype`` (``"bfloat16"``, as Qwen3 releases) is what the weights are stored in and what the
    config declares; the random values are drawn in float32 first, so only the rounding differs.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family in IMAGE_TEXT:
        extra_special_tokens = tuple(extra_special_tokens) + tuple(
            t for t in VISION_SPECIAL_TOKENS if t not in extra_special_tokens)
    if family == "gpt_oss":
        extra_special_tokens = tuple(extra_special_tokens) + GPT_OSS_SPECIAL_TOKENS
    tok = train_bpe_tokenizer(shape.vocab_size, seed, tuple(extra_special_tokens))
    eos_id = tok.token_to_id("<|endoftext|>")
    pad_id = tok.token_to_id("<|pad|>")
    config = _hf_config(family, shape, tok.get_vocab_size(), eos_id, pad_id, tok)
    torch.manual_seed(seed)
    if family in IMAGE_TEXT:
        model = {"qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
                 "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
                 "qwen3_5_moe_vl": transformers.Qwen3_5MoeForConditionalGeneration}[family](config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with a larger spread than HF's default so logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"]
        + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS],
    )
    # Qwen's layout; a message's content may be a list of text and image parts, as Qwen-VL's
    # templates take it (an image becomes its placeholder between the vision markers).
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    if family == "gpt_oss":
        fast.chat_template = _HARMONY_TEMPLATE
    fast.save_pretrained(out)
    if family in IMAGE_TEXT:
        transformers.Qwen2VLImageProcessor(
            patch_size=16, merge_size=2, temporal_patch_size=2,
            size={"shortest_edge": TINY_IMAGE_MIN_PIXELS, "longest_edge": TINY_IMAGE_MAX_PIXELS},
        ).save_pretrained(out)
    (out / "tinsmith_tiny.json").write_text(json.dumps({"family": family, "seed": seed, **shape.__dict__}))
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description="Write a tiny random HF checkpoint with a BPE tokenizer.")
    p.add_argument("out_dir")
    p.add_argument("--family", default="qwen3", choices=FAMILIES)
    p.add_argument("--seed", type=int, default=0)
    for field, default in TinyShape().__dict__.items():
        if isinstance(default, bool):
            p.add_argument(f"--{field.replace('_', '-')}", action="store_true", default=default)
        else:
            p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    a = p.parse_args(argv)
    shape = TinyShape(**{k: getattr(a, k) for k in TinyShape().__dict__})
    print(make_tiny_model(a.out_dir, a.family, shape, a.seed))


if __name__ == "__main__":
    main()
