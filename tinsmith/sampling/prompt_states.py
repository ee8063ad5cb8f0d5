"""Whole prompts' prefill results kept across admissions: hybrid models' states, dense models' tails.

A hybrid model (Qwen3.5: Gated DeltaNet layers beside attention) cannot reuse a cached prefix
from its K/V alone: each linear layer's recurrent state after the prefix would be missing, so
the block prefix cache (:mod:`tinsmith.sampling.prefix_cache`) is off for it. But RL programs
send the same prompt again and again (GRPO as separate requests: 16 per prompt, often arriving
in different scheduler steps), and for an *identical* prompt everything a prefill leaves is
known: each attention layer's K/V, each linear layer's convolution inputs and delta-rule state,
and the logits after the last token. This cache keeps those, least recently used evicted first,
so a prompt sent again is not prefilled again.

Keys are the sampler's share keys (weights version, prompt tokens, images), compared whole: a stale
weights version is never looked up again and ages out. A prompt that *extends* a kept one (the
next turn of a conversation, which repeats the earlier turns) continues from the kept one's
states (:meth:`PromptSnapshots.longest_prefix`): only its new tokens are prefilled.

A prompt with images is kept whole on any model (its K/V sit at positions on its images' grids,
which the block cache, keyed by tokens, cannot tell apart), with its rope delta, and only a
prompt with the same tokens and the same images at the same places reuses it.

Dense models keep less: the block prefix cache holds a prompt's full blocks already, so a
snapshot keeps only what those blocks lack, the K/V of the positions past the last full block
(its *tail*, ``start`` onwards) and the logits after the last token. Without it an admission of
a prompt the cache holds whole would still run a forward pass over its last token (every layer,
eagerly, while the decoding rows wait) just for those logits; with it the rows are seeded at once
from the cached pages, the tail and the kept logits. Only a whole prompt equal to a kept one
uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from tinsmith.sampling.recurrent_state import PrefillStates
from tinsmith.transfers import to_device


@dataclass
class PromptSnapshot:
    """What seeding rows from one prefilled prompt needs (see ``Sampler._seed_rows``)."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer -> (K, V), (kv_heads, length - start, head_dim)
    states: PrefillStates | None  # hybrid models: the prompt's recurrent states, as prompt 0 of a prefill
    last_logits: torch.Tensor  # (vocab,) after the prompt's last token
    length: int
    # Dense models keep the K/V of positions ``start`` onwards only, as ``tail`` (attention layers
    # in order, 2, kv_heads, length - start, head_dim): the positions before are the prefix
    # cache's full blocks. ``kv`` is then empty until the sampler makes the snapshot whole for an
    # admission, with ``pages``: the pool pages of those blocks (a paged cache's rows hold them).
    start: int = 0
    tail: torch.Tensor | None = None
    pages: list[int] = field(default_factory=list)
    # An image prompt's multimodal RoPE offset (its rows decode at position + rope_delta).
    rope_delta: int = 0

    @property
    def nbytes(self) -> int:
        tensors = [t for kv in self.kv.values() for t in kv] + [self.last_logits]
        if self.tail is not None:
            tensors.append(self.tail)
        if self.states is not None:
            tensors += list(self.states.conv.values()) + list(self.states.state.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def of(cls, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], states: PrefillStates | None, prompt: int,
           last_logits: torch.Tensor, length: int, rope_delta: int = 0) -> PromptSnapshot:
        """Copies of prompt ``prompt``'s part of a prefill (K/V trimmed to its ``length``; a hybrid
        model's states too), whole: what a hybrid model keeps, and any model of an image prompt."""
        return cls({layer: (k[prompt, :, :length].clone(), v[prompt, :, :length].clone()) for layer, (k, v) in kv.items()},
                   None if states is None else states.select(prompt), last_logits.detach().clone(), length,
                   rope_delta=rope_delta)

    @classmethod
    def tail_of(cls, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], prompt: int, last_logits: torch.Tensor,
                start: int, length: int) -> PromptSnapshot:
        """A dense model's snapshot: prompt ``prompt``'s K/V at positions ``[start, length)`` (of
        each attention layer of ``kv``, laid out by position as a prefill gives it) stacked into
        one tensor, and a copy of its last logits."""
        return cls.tails_of(kv, [prompt], [last_logits], [start], [length])[0]

    @classmethod
    def tails_of(cls, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], prompts: list[int],
                 last_logits: list[torch.Tensor], starts: list[int], lengths: list[int]) -> list[PromptSnapshot]:
        """:meth:`tail_of` for several prompts of one prefill, each ``prompts[i]`` from ``starts[i]``
        to ``lengths[i]``, in a number of device operations that does not grow with the prompts'
        (one admission may keep hundreds, each a launch per layer the decoding rows wait for):
        every tail's positions gathered per layer and K/V at once, then each prompt's own copied
        out. An empty tail (a prompt of whole blocks) copies nothing."""
        layers = sorted(kv)
        k0 = kv[layers[0]][0]
        widths = [n - s for s, n in zip(starts, lengths)]
        tails = [k0.new_empty((len(layers), 2, k0.shape[1], 0, k0.shape[-1]))] * len(prompts)
        some = [i for i, w in enumerate(widths) if w]
        if some:
            pos = np.minimum(np.array([starts[i] for i in some])[:, None] + np.arange(max(widths)), k0.shape[2] - 1)
            at = to_device(np.stack([np.broadcast_to(np.array([prompts[i] for i in some])[:, None], pos.shape), pos]),
                           k0.device)  # one copy, no wait
            # (prompts, width, layers x K/V, heads, head_dim): positions past a prompt's length are dropped below
            gathered = torch.stack([kv[layer][which][at[0], :, at[1]] for layer in layers for which in (0, 1)], dim=2)
            for j, i in enumerate(some):
                t = gathered[j, : widths[i]].permute(1, 2, 0, 3).contiguous()  # a copy: the prompt's own
                tails[i] = t.view(len(layers), 2, *t.shape[1:])  # (layers, K/V, heads, width, head_dim)
        return [cls({}, None, logits.detach().clone(), n, s, tail)
                for logits, s, n, tail in zip(last_logits, starts, lengths, tails)]


class PromptSnapshots:
    """Snapshots under a byte budget (0: nothing is kept), least recently used evicted first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Hashable, PromptSnapshot] = OrderedDict()
        self.bytes = 0
        self.stats = {"hits": 0, "evicted": 0}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Hashable) -> PromptSnapshot | None:
        snap = self.entries.get(key)
        if snap is not None:
            self.entries.move_to_end(key)
            self.stats["hits"] += 1
        return snap

    def peek(self, key: Hashable) -> PromptSnapshot | None:
        """The snapshot kept under ``key``, marking nothing used (admission looks before it takes)."""
        return self.entries.get(key)

    def longest_prefix(self, weights: Hashable, prompt: bytes) -> PromptSnapshot | None:
        """The longest kept text prompt that ``prompt`` (token bytes) starts with or equals,
        computed by ``weights`` and kept without prompt logits (keys as the sampler's share keys:
        weights, prompt logits asked, tokens, images)."""
        best = None
        for key in self.entries:
            w, logits, tokens, images = key  # type: ignore[misc]
            if (w == weights and not logits and not images and len(tokens) <= len(prompt)
                    and (best is None or len(tokens) > len(best[2])) and prompt.startswith(tokens)):
                best = key
        return None if best is None else self.get(best)

    def put(self, key: Hashable, snap: PromptSnapshot) -> None:
        """Keep ``snap`` (one larger than the whole budget is not kept)."""
        size = snap.nbytes
        if not self.enabled or size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.stats["evicted"] += 1
        self.entries[key] = snap
        self.bytes += size

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
