"""The serving sampler over a sharded model.

The sampler only reads ``model.logits`` (whole: the sharded LM head gathers its vocabulary
blocks) and its KV cache, so running it sharded takes a cache of this rank's key/value heads.
Every rank runs the same sampler with the same tasks in the same order; since every rank sees
the same full logits and the same seeds, every rank draws the same tokens.

Not yet done for serving: :meth:`Sampler.step` stops on a time budget, which differs between
ranks; under the SPMD executor each step must run an agreed number of decode steps instead.
"""

from __future__ import annotations

import dataclasses

from tinsmith.models.layers import CausalLM
from tinsmith.sampling.kv_cache import RowKVCache
from tinsmith.sampling.sampler import Sampler
from tinsmith.parallel.shard import tp_of
from tinsmith.parallel.state import lora_shard_dims, scatter_full
from tinsmith.types import LoraSpec
from tinsmith.worker.trainables import install_lora_weights


class ShardedSampler(Sampler):
    """:class:`Sampler` whose KV cache holds this rank's key/value heads only."""

    def __init__(self, model: CausalLM, decode, **kwargs):
        super().__init__(model, decode, **kwargs)
        local_heads = model.model.layers[0].self_attn.num_kv_heads
        self.cache = RowKVCache(dataclasses.replace(self.cfg, num_kv_heads=local_heads), self.device, self.dtype)


def install_full_lora_weights(model: CausalLM, slot: int, spec: LoraSpec, tensors: dict) -> None:
    """Put a frozen adapter given at full size (a checkpoint, a sampler snapshot) into ``slot``,
    keeping this rank's shards."""
    install_lora_weights(model, slot, spec, scatter_full(tensors, lora_shard_dims(model), tp_of(model)))
