"""Greedy decoding with a (possibly sharded) model: a plain KV cache, split by heads like the model.

Each rank caches the keys and values of its own attention heads only, so the cache shrinks with
the tensor-parallel size as the weights do. The next token is the argmax of the full logits
(the sharded LM head gathers the ranks' vocabulary blocks), so every rank picks the same token. This is the
reference decode loop for tensor parallelism (and its tests); attention sinks and sliding
windows (gpt-oss) go through the model's own masked attention.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinsmith.models.layers import CausalLM, masked_attention


class HeadShardedKVCache:
    """An attention backend that appends each layer's keys/values and attends over all of them."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        if layer_idx in self.k:
            k = torch.cat((self.k[layer_idx], k), dim=2)
            v = torch.cat((self.v[layer_idx], v), dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        lq, lk = q.shape[2], k.shape[2]
        gqa = k.shape[1] != q.shape[1]
        if lq == lk and sinks is None and window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        pos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # each query's position
        keys = torch.arange(lk, device=q.device)[None, :]
        allowed = keys <= pos
        if window is not None:  # a sliding layer (gpt-oss) sees its last ``window`` positions
            allowed &= keys > pos - window
        return masked_attention(q, k, v, allowed[None], sinks)


@torch.no_grad()
def greedy_decode(model: CausalLM, prompts: torch.Tensor, max_new_tokens: int, slot: int | None = None) -> torch.Tensor:
    """``max_new_tokens`` greedy tokens after each row of ``prompts`` (b, L), equal-length rows;
    ``slot`` names a LoRA adapter to decode with. Returns (b, max_new_tokens)."""
    b, L = prompts.shape
    cache = HeadShardedKVCache()
    tokens, start, out = prompts, 0, []
    for _ in range(max_new_tokens):
        n = tokens.shape[1]
        positions = torch.arange(start, start + n, device=prompts.device).expand(b, n)
        segments = None if slot is None else [(slot, 0, b * n)]
        h = model.hidden_states(tokens, positions, segments, attend=cache)[:, -1]
        nxt = model.logits(h, None if slot is None else [(slot, 0, b)]).argmax(-1)  # whole vocabulary
        out.append(nxt)
        tokens, start = nxt[:, None], start + n
    return torch.stack(out, dim=1)
