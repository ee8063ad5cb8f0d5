"""The serving sampler over a sharded model.

The sampler only reads ``model.logits`` (whole: the sharded LM head gathers its vocabulary
blocks) and its KV cache, so running it sharded takes a cache of this rank's key/value heads.
Every rank runs the same sampler with the same tasks in the same order; since every rank sees
the same full logits and the same seeds, every rank draws the same tokens.

For serving, :class:`LockstepSampler` makes the ranks agree on what differs between them: how
many decode steps a slice runs (rank 0's time budget decides, before each step) and which
requests were cancelled (rank 0 reads the cancellation board).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from tinsmith.models.layers import CausalLM
from tinsmith.sampling.cancel import SampleCancelled
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.parallel.comm import all_reduce_
from tinsmith.parallel.group import ParallelError, TPGroup, group_rank_zero, guarded
from tinsmith.parallel.shard import tp_of
from tinsmith.parallel.state import lora_shard_dims, scatter_full
from tinsmith.types import LoraSpec
from tinsmith.worker.trainables import install_lora_weights


class ShardedSampler(Sampler):
    """:class:`Sampler` whose KV cache holds this rank's key/value heads only."""

    def __init__(self, model: CausalLM, decode, **kwargs):
        super().__init__(model, decode, **kwargs)
        layers = model.model.layers
        local_heads = next(layer.self_attn.num_kv_heads for layer in layers if hasattr(layer, "self_attn"))
        # K/V shapes everywhere in the sampler (cache rows, prefix-cache blocks, admission bytes)
        # are this rank's heads, and so are a hybrid model's recurrent states (its Gated DeltaNet
        # heads); the rest of the config is the model's.
        self.cfg = dataclasses.replace(self.cfg, num_kv_heads=local_heads)
        linear = next((layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")), None)
        if linear is not None:
            self.cfg = dataclasses.replace(self.cfg, linear_attn=dataclasses.replace(
                self.cfg.linear_attn, num_key_heads=linear.nk, num_value_heads=linear.nv))
        # Admission decisions must be equal on every rank: one K/V budget, the smallest of theirs
        # (each derives its default from its own device's free memory).
        budget = torch.tensor([self.kv_cache_bytes or float("inf")], dtype=torch.float64,  # 0: no bound
                              device=self.device if self.device.type == "cuda" else "cpu")
        all_reduce_(budget, tp_of(model), op=dist.ReduceOp.MIN, what="agreeing on the sampler's K/V budget")
        self.kv_cache_bytes = 0 if budget.item() == float("inf") else int(budget.item())
        self.cache = self._new_cache()
        self.prefix = self._new_prefix_cache()  # its blocks hold this rank's heads (pages of this cache)
        # Whether to queue a burst ahead depends on each rank's own clock and inbox; ranks that
        # decided differently would run different collectives. Every rank reads each burst first.
        self.run_ahead = False
        if self.graphs is not None:  # the static decode step reads this rank's cache, and captures agree
            self.graphs.cache = self.cache
            self.graphs.peers = GraphPeers(tp_of(model), self.device)


class GraphPeers:
    """The tensor-parallel group as the decode graphs' :class:`~tinsmith.sampling.decode_graphs.Peers`."""

    def __init__(self, tp: TPGroup, device: torch.device):
        self.tp = tp
        self.device = device if device.type == "cuda" else torch.device("cpu")  # NCCL: device tensors
        self._fence = torch.zeros(1, device=self.device)

    def all_ok(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.long, device=self.device)
        all_reduce_(flag, self.tp, op=dist.ReduceOp.MIN, what="agreeing on a decode graph capture")
        return bool(flag.item())

    def fence(self) -> None:
        all_reduce_(self._fence, self.tp, what="decode burst fence")


class LockstepSampler(ShardedSampler):
    """A sharded sampler whose ranks run the same decode steps although only rank 0 keeps time.

    Before each decode step rank 0 broadcasts whether to run it (its time budget is not spent)
    and the ids of the requests cancelled since it last looked; every rank acts on that, so the
    ranks' batches stay equal and their collectives meet. Tasks carry an id every rank agrees
    on (:meth:`add_agreed`); the key a task holds may differ (the engine's job on rank 0).
    """

    fatal_errors = (ParallelError,)

    def __init__(self, model: CausalLM, decode, **kwargs):
        super().__init__(model, decode, **kwargs)
        self.tp = tp_of(model)
        self._tid_of: dict[int, int] = {}  # id(key) -> the task's agreed id
        self._key_of: dict[int, Any] = {}
        self.agreements = 0  # broadcasts of the decision, counted for tests

    def add_agreed(self, tid: int, key: Any, slot: int | None, inp, owner: str | None = None) -> None:
        self._tid_of[id(key)], self._key_of[tid] = tid, key
        self.add(SampleTask(key, slot, inp, owner))

    def forget(self, key: Any) -> None:
        """The task with ``key`` was reported: its id is no longer needed."""
        self._key_of.pop(self._tid_of.pop(id(key), -1), None)

    def holds(self, key: Any) -> bool:
        return id(key) in self._tid_of

    def _drop_cancelled(self, done: list) -> None:
        self._drop(self._agree(True)[1], done)

    def _go_on(self, deadline: float, done: list) -> bool:
        go, cancelled = self._agree(time.perf_counter() < deadline)
        self._drop(cancelled, done)
        return go

    def _agree(self, go: bool) -> tuple[bool, list[int]]:
        """Rank 0's ``go`` and cancelled task ids, on every rank (one small broadcast, two when
        something was cancelled)."""
        self.agreements += 1
        ids: list[int] = []
        board = self.cancellations
        if self.tp.rank == 0 and board is not None and board.version != self._cancel_version:
            self._cancel_version = board.version
            if len(board):
                keys = [t.key for t in list(self.inbox)] + [s.task.key for s in self._live_states()]
                ids = sorted({self._tid_of[id(k)] for k in keys if board.wants(k)})
        if self.tp.size == 1:
            return go, ids
        dev = self.device if dist.get_backend(self.tp.group) == "nccl" else torch.device("cpu")
        head = torch.tensor([int(go), len(ids)], dtype=torch.long, device=dev)
        src = group_rank_zero(self.tp)  # the group's first rank (not world rank 0 when it is one replica's group)
        guarded(self.tp, "sampler step agreement", lambda: dist.broadcast(head, src, group=self.tp.group))
        go_all, n = head.tolist()
        if n:
            body = torch.tensor(ids, dtype=torch.long, device=dev) if self.tp.rank == 0 else \
                torch.empty(n, dtype=torch.long, device=dev)
            guarded(self.tp, "sampler cancellation broadcast", lambda: dist.broadcast(body, src, group=self.tp.group))
            ids = body.tolist()
        return bool(go_all), ids

    def _drop(self, ids: list[int], done: list) -> None:
        """Drop the queued and running requests with these agreed ids (cancelled by their clients)."""
        keys = {id(self._key_of[t]) for t in ids if t in self._key_of}
        if not keys:
            return
        cancelled = SampleCancelled("the request was cancelled by its client")
        for task in [t for t in list(self.inbox) if id(t.key) in keys]:
            self.inbox.remove(task)
            done.append((task.key, cancelled))
            self.stats["cancelled"] += 1
        states = [s for s in self._live_states() if id(s.task.key) in keys]
        if states:
            self.stats["cancelled"] += len(states)
            self._fail(states, cancelled, done)


def install_full_lora_weights(model: CausalLM, slot: int, spec: LoraSpec, tensors: dict) -> None:
    """Put a frozen adapter given at full size (a checkpoint, a sampler snapshot) into ``slot``,
    keeping this rank's shards."""
    install_lora_weights(model, slot, spec, scatter_full(tensors, lora_shard_dims(model), tp_of(model)))
