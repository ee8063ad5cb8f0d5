"""Sharded versions of tinsmith's projections and embedding (subclasses, so every caller that
takes a :class:`LoraLinear` takes them).

* :class:`ColumnParallelLoraLinear` keeps a contiguous block of output rows (attention heads,
  MLP columns, vocabulary rows); its input is replicated. LoRA: ``A`` whole on every rank
  (its partial gradients summed over ranks before each step), ``B`` sharded by output like the
  weight.
* :class:`RowParallelLoraLinear` keeps the matching block of input columns and sums the ranks'
  partial outputs with one all-reduce. LoRA: ``A`` sharded by input, ``B`` whole; the partial
  ``x A_r^T B^T`` joins the layer's all-reduce, so the adapter costs no extra collective forward.
* :class:`VocabParallelEmbedding` keeps a block of vocabulary rows; a token another rank owns
  reads zeros here, and the all-reduce assembles every row.
* :class:`ExpertParallelMoeBlock` keeps a contiguous block of a mixture-of-experts layer's
  experts (expert parallelism inside the group, whose ranks all hold every token): the router
  is replicated, each rank runs the pairs routed to its own experts, and one all-reduce sums the
  ranks' shares, as after a row-parallel projection. LoRA: each expert's ``A``/``B`` live with
  the expert (:class:`ExpertParallelLinear`), whole.

Adapters are drawn at full size with the caller's generator and then sliced, so a seed gives
the same adapter under any tensor-parallel size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tinsmith.models.lora import LoraLinear, LoraWeights, PackedProjection, Segments, RowGroups, new_lora_weights
from tinsmith.models.lora_bank import RowSlots
from tinsmith.models.layers import SharedExpertMoeBlock
from tinsmith.models.moe import ExpertLinear, PackedGateUp, SparseMoeBlock
from tinsmith.parallel.comm import copy_to_tp, gather_from_tp, mark_replicated, mark_shared, reduce_from_tp
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.state import Split


class ColumnParallelLoraLinear(LoraLinear):
    """Output rows ``rows`` of a full ``(full_out, in)`` projection.

    ``order`` (instead of ``rows``) lists the full rows rank after rank, for outputs whose ranks'
    shares are not contiguous blocks: a permutation (Gated DeltaNet's fused q/k/v: each rank keeps
    its heads' rows of all three), or with repeats (a key/value head kept by several ranks when
    the tensor-parallel size exceeds the key/value heads); rank ``r`` keeps rows
    ``order.chunk(tp.size)[r]``.
    """

    def __init__(self, full: LoraLinear, rows: slice | None, tp: TPGroup, weight: nn.Parameter | None = None,
                 gather_output: bool = False, copy_input: bool = True, order: torch.Tensor | None = None):
        self.order = order
        if order is not None:
            rows = order.chunk(tp.size)[tp.rank]  # type: ignore[assignment]
        assert rows is not None
        super().__init__(full.in_features, len(range(full.out_features)[rows]) if isinstance(rows, slice) else len(rows),
                         bias=False)
        self.tp, self.rows = tp, rows
        # False where the input already passed :func:`copy_to_tp` (:class:`CopyToTP` after a norm
        # that feeds several projections: one gradient all-reduce for q, k and v together).
        self.copy_input = copy_input
        # Megatron's option: return the full output (all ranks' rows), for an LM head whose
        # logits callers (the sampler) read whole. Training reads the shard via ``weight``.
        self.gather_output = gather_output
        self.full_in, self.full_out = full.in_features, full.out_features
        # ``weight`` is given when it is shared (an LM head tied to the embedding's shard).
        self.weight = weight if weight is not None else nn.Parameter(
            full.weight.detach()[rows].clone(), requires_grad=False)
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach()[rows].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | None = None) -> torch.Tensor:
        y = super().forward(copy_to_tp(x, self.tp) if self.copy_input else x, segments)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        w = new_lora_weights((rank, self.full_in), (self.full_out, rank), self.full_in, alpha / rank, generator,
                             self.weight.device)
        A = mark_replicated(w.A)
        B = w.B.detach()[self.rows].clone().requires_grad_()
        if self.order is not None and len(self.order) > self.full_out:  # rows other ranks hold too
            mark_shared(B, 0, self.rows, self.full_out)
        self.adapters[slot] = out = LoraWeights(A, B, w.scale)
        return out

    def shard_dims(self) -> tuple[int | None, Split | None]:
        """Which dimension of (A, B) is split over the ranks (None: held whole; with the
        permutation of the full dimension when the ranks' shares are not contiguous blocks)."""
        return None, (0 if self.order is None else (0, self.order))


class RowParallelLoraLinear(LoraLinear):
    """Input columns ``cols`` of a full ``(out, full_in)`` projection; outputs summed over ranks
    (``reduce`` False: left partial, for a caller that adds it to other partial sums and
    reduces once)."""

    def __init__(self, full: LoraLinear, cols: slice, tp: TPGroup, reduce: bool = True):
        super().__init__(cols.stop - cols.start, full.out_features, bias=False)
        assert reduce or full.bias is None, "a partial output cannot take the bias once"
        self.tp, self.cols, self.reduce = tp, cols, reduce
        self.full_in, self.full_out = full.in_features, full.out_features
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone(), requires_grad=False)
        # The bias is added once, after the sum (inside F.linear it would be added once per rank).
        self.bias_after = (nn.Parameter(full.bias.detach().clone(), requires_grad=False)
                           if full.bias is not None else None)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | None = None) -> torch.Tensor:
        y = super().forward(x, segments)
        if not self.reduce:
            return y
        y = reduce_from_tp(y, self.tp)
        return y if self.bias_after is None else y + self.bias_after

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        w = new_lora_weights((rank, self.full_in), (self.full_out, rank), self.full_in, alpha / rank, generator,
                             self.weight.device)
        A = w.A.detach()[:, self.cols].clone().requires_grad_()
        B = mark_replicated(w.B)
        self.adapters[slot] = out = LoraWeights(A, B, w.scale)
        return out

    def shard_dims(self) -> tuple[int | None, int | None]:
        return 1, None


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows ``rows`` of a frozen ``(vocab, hidden)`` embedding."""

    def __init__(self, full: nn.Embedding, rows: slice, tp: TPGroup):
        super().__init__()
        self.tp, self.rows = tp, rows
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.rows.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return reduce_from_tp(h * mine[..., None].to(h.dtype), self.tp)


class CopyToTP(nn.Module):
    """``inner`` (a norm), then :func:`copy_to_tp`: the replicated input of the sharded projections
    after it enters them once, so their partial input gradients are summed in one all-reduce."""

    def __init__(self, inner: nn.Module, tp: TPGroup):
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(self.inner(x), self.tp)

    @property
    def inference_norm(self) -> nn.Module:
        """The norm alone: outside autograd ``copy_to_tp`` changes nothing (see ``layers.add_rms_norm``)."""
        return self.inner


class ExpertParallelLinear(ExpertLinear):
    """Experts ``experts`` of a full stacked ``(full_experts, out, in)`` expert projection."""

    def __init__(self, full: ExpertLinear, experts: slice):
        super().__init__(experts.stop - experts.start, full.in_features, full.out_features, bias=full.bias is not None)
        self.experts, self.full_experts = experts, full.num_experts
        self.weight = nn.Parameter(full.weight.detach()[experts].clone(), requires_grad=False)
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach()[experts].clone(), requires_grad=False)

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        w = new_lora_weights((self.full_experts, rank, self.in_features), (self.full_experts, self.out_features, rank),
                             self.in_features, alpha / rank, generator, self.weight.device)
        A = w.A.detach()[self.experts].clone().requires_grad_()
        B = w.B.detach()[self.experts].clone().requires_grad_()
        self.adapters[slot] = out = LoraWeights(A, B, w.scale)
        return out

    def shard_dims(self) -> tuple[int | None, int | None]:
        return 0, 0  # both split by expert


def _take_routed(module: nn.Module, block: SparseMoeBlock, experts: slice, tp: TPGroup) -> None:
    """Give ``module`` (a new expert-parallel block) ``block``'s router, whole, and its routed
    experts cut to ``experts``."""
    nn.Module.__init__(module)
    module.tp = tp
    module.router_name = block.router_name
    module.add_module(block.router_name, getattr(block, block.router_name))
    ex = module.experts = block.experts
    packed = ex.packed_gate_up is not None
    ex.gate_proj = ExpertParallelLinear(ex.gate_proj, experts)
    ex.up_proj = ExpertParallelLinear(ex.up_proj, experts)
    ex.down_proj = ExpertParallelLinear(ex.down_proj, experts)
    # The packed buffer held every expert; this rank's experts get one of their own.
    ex.packed_gate_up = PackedGateUp(ex.gate_proj, ex.up_proj, ex.activation) if packed else None
    module.expert_start = experts.start


class ExpertParallelMoeBlock(SparseMoeBlock):
    """This rank's experts ``experts`` of ``block`` (its router kept whole); outputs summed over ranks.

    Its input is the replicated stream after a :class:`CopyToTP` norm, so the ranks' partial
    input gradients (each through its own experts and its share of the routing weights) are
    summed there.
    """

    def __init__(self, block: SparseMoeBlock, experts: slice, tp: TPGroup):
        _take_routed(self, block, experts, tp)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | RowSlots | None) -> torch.Tensor:
        return reduce_from_tp(super().forward(x, segments), self.tp)


class ExpertParallelSharedMoeBlock(SharedExpertMoeBlock):
    """:class:`ExpertParallelMoeBlock` with Qwen3.5-MoE's shared expert, split Megatron-style
    (gate/up by columns, down by rows): the routed and the gated shared partial sums leave
    through one all-reduce together (the gate, a frozen (1, hidden) projection, is replicated)."""

    def __init__(self, block: SharedExpertMoeBlock, experts: slice, inter: slice, tp: TPGroup):
        _take_routed(self, block, experts, tp)
        shared = self.shared_expert = block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        shared.gate_proj = ColumnParallelLoraLinear(shared.gate_proj, inter, tp, copy_input=False)
        shared.up_proj = ColumnParallelLoraLinear(shared.up_proj, inter, tp, copy_input=False)
        shared.down_proj = RowParallelLoraLinear(shared.down_proj, inter, tp, reduce=False)
        shared.packed_gate_up = PackedProjection([shared.gate_proj, shared.up_proj])  # this rank's columns

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | RowSlots | None) -> torch.Tensor:
        return reduce_from_tp(super().forward(x, segments), self.tp)
