"""The training runtime on one rank of a tensor-parallel group.

Every rank runs the same calls with the same requests (see :mod:`tinsmith.parallel.spmd`);
each computes with its shards, and results (logprobs, losses, metrics) come out the same on all
ranks. What differs from :class:`TrainingRuntime`: target logprobs come from the
vocabulary-parallel head, the gradient norm of a unit sums its shards over ranks, and state
moves in and out at full size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tinsmith.errors import InvalidInputError, TinsmithError
from tinsmith.models.chunked_logprobs import UnembedLora, rows_per_chunk
from tinsmith.models.lora import Segments
from tinsmith.optim import ADAMW, DIMUON, check_params_match
from tinsmith.parallel.comm import all_reduce_, is_replicated, shared_copies, sum_replicated_grads, sum_shared_grads
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.logprobs import vocab_parallel_target_logprobs
from tinsmith.parallel.shard import tp_of
from tinsmith.parallel.sharded_dimuon import ShardedDimuon
from tinsmith.parallel.state import ShardDims, gather_full, lora_shard_dims, scatter_full, split_of
from tinsmith.types import LoraSpec, OptimParams
from tinsmith.worker.joint_steps import plain_adamw
from tinsmith.worker.runtime import TrainingRuntime, repeats_a_unit
from tinsmith.worker.trainables import Trainable, squared_grad_norms


@dataclass
class ShardedTrainable(Trainable):
    """A LoRA unit whose tensors are partly sharded: the whole tensors' partial gradients are
    summed over ranks when it steps, and its gradient norm counts every shard once."""

    tp: TPGroup = TPGroup.single()
    shard_dims: ShardDims = field(default_factory=dict)  # how each of its tensors is split over the ranks

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimizer_type == DIMUON and self.tp.size > 1:
            # Dimuon's direction needs whole matrices: the split factors' momenta are gathered.
            self.optimizer = ShardedDimuon(self.params, [split_of(n, self.shard_dims) for n, _ in self.named_params],
                                           self.tp, rank=self.spec.rank if self.spec is not None else None)

    def step(self, hp: OptimParams) -> dict[str, float]:
        check_params_match(self.optimizer_type, hp)  # before the collective: refused alike on every rank
        sum_replicated_grads(self.params, self.tp)
        sum_shared_grads(self.params, self.tp)
        return super().step(hp)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        sharded, whole = self.squared_parts(params)
        sq = all_reduce_(sharded, self.tp, what="gradient-norm all_reduce")
        return (sq + whole).sqrt()

    def squared_parts(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared gradient norm of ``params`` in two parts: this rank's share of the sharded
        tensors (summed over the ranks, it counts every shard once: a part several ranks hold
        alike, a shared key/value head's B, is divided by its copies) and the whole tensors'
        (every rank's the same, once the step summed their partial gradients)."""
        zero = torch.zeros((), dtype=torch.float32, device=params[0].device)
        by_copies: dict[int, list[torch.Tensor]] = {}
        for p in params:
            if not is_replicated(p):
                by_copies.setdefault(shared_copies(p, self.tp), []).append(p.grad)
        sharded = sum((squared_grad_norms(grads).sum() / copies for copies, grads in by_copies.items()), zero)
        whole = [p.grad for p in params if is_replicated(p)]
        return sharded, squared_grad_norms(whole).sum() if whole else zero


def sharded_grad_norms(entries: list[tuple[Trainable, list[torch.Tensor]]], tp: TPGroup) -> list[float]:
    """Several sharded units' gradient norms (each as :meth:`ShardedTrainable.grad_norm` gives
    it) from one all-reduce of their sharded parts and one read-back."""
    parts = [unit.squared_parts(params) for unit, params in entries]  # type: ignore[attr-defined]
    sq = all_reduce_(torch.stack([sharded for sharded, _ in parts]), tp, what="gradient-norm all_reduce")
    return (sq + torch.stack([whole for _, whole in parts])).sqrt().tolist()


class TPTrainingRuntime(TrainingRuntime):
    """:class:`TrainingRuntime` over a model sharded by :func:`shard_causal_lm`."""

    def __init__(self, model, **kwargs):
        if kwargs.get("full_finetune"):
            raise InvalidInputError("a tensor-parallel shard does not train a full fine-tune: it runs sharded with FSDP "
                                    "over the whole group")
        super().__init__(model, **kwargs)
        self.tp = tp_of(model)
        self.shard_dims = lora_shard_dims(model)

    def create_adapter(self, spec: LoraSpec, optimizer_type: str = ADAMW) -> int:
        unit = super().create_adapter(spec, optimizer_type)
        # Every field of the unit attach_lora made (its model above all: each step and load tells
        # the model, whose weights version keys the inflight sampler's prefix cache).
        t = self.units[unit]
        self.units[unit] = ShardedTrainable(**{f.name: getattr(t, f.name) for f in fields(t) if f.init}, tp=self.tp,
                                            shard_dims=self.shard_dims)
        return unit

    def optim_steps(self, requests: list[tuple[int, OptimParams]]) -> list[dict[str, float] | Exception]:
        """Several adapters' steps: the whole factors' partial gradients of all of them summed in
        one all-reduce (and the shared parts' in one), their norms in one, then one set of AdamW
        kernels for all (AdamW is elementwise: exact on shards)."""
        if repeats_a_unit(requests):
            return super().optim_steps(requests)

        def sum_them(units: list[tuple[Trainable, OptimParams]]) -> None:
            stepping = [p for tr, params in units if joins(tr) and params_match(tr, params) for p in tr.params]
            sum_replicated_grads(stepping, self.tp)
            sum_shared_grads(stepping, self.tp)

        def joins(unit: Trainable) -> bool:
            return isinstance(unit, ShardedTrainable) and plain_adamw(unit)

        return self._steps_together(requests, prepare=sum_them, joins=joins,
                                    norms=lambda entries: sharded_grad_norms(entries, self.tp))

    def _target_logprobs(self, h: torch.Tensor, segs: Segments, rows: torch.Tensor, cols: torch.Tensor,
                         rows_host: torch.Tensor, one_per_row: bool = False) -> torch.Tensor:
        # one_per_row: unused, the vocabulary-parallel backward keeps the torch path
        head = self.model.lm_head
        loras = [UnembedLora(w.A, w.B, w.scale, a, b)
                 for slot, a, b in segs if slot is not None and (w := head.adapters.get(slot)) is not None]
        return vocab_parallel_target_logprobs(
            h, head.weight, rows, cols, self.tp, head.rows.start, bias=head.bias, loras=loras,
            chunk_rows=rows_per_chunk(self.config.vocab_size, self.logit_chunk_bytes), rows_host=rows_host)

    # ----------------------------------------------------------------------------- full-size state
    def export_full_state(self, unit: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The unit's weights and optimizer state at full size, as one process would export them."""
        if self.unit(unit).slot is not None:
            self.ensure_resident({unit})  # a parked adapter's shards are in host memory, NCCL gathers on the device
        weights, opt = self.unit(unit).export_state()
        return gather_full(weights, self.shard_dims, self.tp), gather_full(opt, self.shard_dims, self.tp)

    def import_full_state(self, unit: int, weights: dict[str, torch.Tensor],
                          optimizer: dict[str, torch.Tensor] | None) -> None:
        """Load full-size weights (and optimizer state) saved under any tensor-parallel size."""
        tr = self.unit(unit)
        if tr.slot is not None:
            self.ensure_resident({unit})
        tr.import_state(scatter_full(weights, self.shard_dims, self.tp),
                        None if optimizer is None else scatter_full(optimizer, self.shard_dims, self.tp))

    def full_grads(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's accumulated gradients at full size (for checks; every rank gets them)."""
        named = self.unit(unit).named_stepped
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in named}
        for n, p in named:  # whole tensors hold partial gradients until the step sums them
            if is_replicated(p):
                all_reduce_(grads[n], self.tp, what="gradient all_reduce")
        params = [p for _, p in named]
        saved = [p.grad for p in params]
        for p, n in zip(params, grads):  # shared parts: summed among their holders, on the copies
            p.grad = grads[n]
        sum_shared_grads(params, self.tp)
        for p, g in zip(params, saved):
            p.grad = g
        return gather_full(grads, self.shard_dims, self.tp)


def params_match(unit: Trainable, params: OptimParams) -> bool:
    """Whether ``params`` are of ``unit``'s optimizer family (else its step is refused, alike on
    every rank, and its gradients are left as they are)."""
    try:
        check_params_match(unit.optimizer_type, params)
    except TinsmithError:
        return False
    return True
