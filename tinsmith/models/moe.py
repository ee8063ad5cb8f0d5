"""Routed experts (Qwen3-MoE style) whose every expert can carry tenant LoRA adapters.

Each routed (token, expert) pair becomes one row; rows are sorted by expert so that every
expert's rows are contiguous, and each projection of all experts runs as one grouped matmul
(``torch._grouped_mm`` on GPUs that have it, a loop over the experts that received rows
otherwise). Adapters follow the same grouping: an adapter owns one ``A``/``B`` pair per expert
(stacked as ``experts x rank x in`` / ``experts x out x rank``), applied to the rows of its own
tokens. The router is frozen and reproduces transformers' ``Qwen3MoeTopKRouter`` exactly:
softmax in fp32, top-k, renormalised when ``norm_topk_prob``, weights cast back to the
activations' dtype; expert outputs are weighted in that dtype and summed per token in
ascending expert order, as transformers' eager experts do.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from tinsmith.models.config import ModelConfig
from tinsmith.kernels.lora_gather import expand, shrink
from tinsmith.models.grouped_lora import stack_lora
from tinsmith.models.lora import LoraWeights, RowGroups, Segments, new_lora_weights
from tinsmith.models.lora_bank import AdapterSlots, LoraBank, RowSlots

EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")

# How per-group matmuls run (routed experts; several tenants' LoRA in a training micro-batch):
# "auto" (grouped on GPUs that support it, a loop elsewhere), "loop" or "grouped" (forced; tests
# compare the two).
GROUPED_MM = "auto"
# The most groups one ``torch._grouped_mm`` takes: its CUDA kernels refuse 1024 or more (the CPU's
# has no limit). Several adapters' experts (adapters x experts groups) are cut into calls of at
# most this many.
MAX_GROUPS = 1023


@dataclass
class ExpertGroups:
    """Row counts per expert for rows sorted by expert (``counts[e]`` rows of expert ``e``).

    ``rest``: the count of rows after every group's that no group computes (under expert
    parallelism, the other ranks' pairs kept beside this rank's; None: there are none). The
    grouped matmul leaves such rows undefined; whoever keeps them drops their results."""

    counts: torch.Tensor  # (experts,) int64, on the rows' device
    rest: torch.Tensor | None = None  # () int64, on the rows' device
    _host: list[int] | None = field(default=None, repr=False)
    _offsets: torch.Tensor | None = field(default=None, repr=False)

    @property
    def host_counts(self) -> list[int]:
        if self._host is None:
            self._host = self.counts.tolist()
        return self._host

    @property
    def offsets(self) -> torch.Tensor:
        """Cumulative end row of each group (int32), what ``torch._grouped_mm`` takes."""
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts, 0, dtype=torch.int32)
        return self._offsets


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` of ``x`` with stacked ``weight`` (groups x out x in) is the fast path here."""
    return weight.shape[0] <= MAX_GROUPS and grouped_mm_fits(x, weight.dtype, weight.shape[-2], weight.shape[-1])


def grouped_mm_fits(x: torch.Tensor, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """:func:`grouped_mm_usable` from the stacked weight's dtype and sizes (no tensor needed)."""
    if GROUPED_MM != "auto":
        return GROUPED_MM == "grouped"
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != torch.bfloat16 or dtype != torch.bfloat16:
        return False
    if out_features % 8 or in_features % 8:  # 16-byte aligned rows for the bf16 kernel
        return False
    return _fast_grouped_kernel(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _fast_grouped_kernel(device_index: int) -> bool:
    """Hopper always; Ampere and newer from torch 2.9 (asked once per device)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return major == 9 or (torch_version >= (2, 9) and (major, minor) >= (8, 0))


def capture_blocker(model: nn.Module) -> str | None:
    """Why ``model``'s decode step cannot be recorded as a CUDA graph (None: nothing here stops
    it). Routed experts that the grouped matmul does not take (fp32 or fp16 weights, a GPU without
    its fast kernel) split their rows by counts read back to the host, which a capture refuses:
    better known before a capture is tried than from its failure."""
    for m in model.modules():
        if isinstance(m, ExpertLinear):
            if not grouped_mm_usable(m.weight.new_empty(0, m.in_features), m.weight):
                return (f"its routed experts ({str(m.weight.dtype).removeprefix('torch.')}) run as a loop over "
                        "per-expert row counts read back to the host; only bf16 experts on a GPU whose grouped "
                        "matmul is fast decode from CUDA graphs")
    return None


def expert_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the routed pairs ``chosen`` (expert ids) each expert received, (experts,) int64.

    A scatter-add, not ``torch.bincount``: on CUDA bincount reads the largest id back to the host
    to size its output, which would keep a decode step out of a CUDA graph. With the grouped
    matmul (bf16 on Hopper) nothing else in the routed path asks the host, so a mixture-of-experts
    decode step can be captured."""
    return torch.zeros(num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen, dtype=torch.long))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for every expert ``e``, rows sorted by expert; (rows, out)."""
    if grouped_mm_usable(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=groups.offsets)
    counts = groups.host_counts
    pieces = [F.linear(xe, weight[e]) for e, xe in enumerate(x.split(counts)) if counts[e]]
    if not pieces:
        return x.new_zeros(0, weight.shape[-2])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def add_expert_bias(y: torch.Tensor, bias: torch.Tensor | None, groups: ExpertGroups) -> torch.Tensor:
    """``y`` (rows sorted by expert) plus each row's expert's bias."""
    if bias is None:
        return y
    if groups.rest is not None:  # rows no group computes take a zero bias
        bias, counts = torch.cat((bias, bias.new_zeros(1, bias.shape[1]))), torch.cat((groups.counts, groups.rest[None]))
        return y + bias.repeat_interleave(counts, dim=0, output_size=y.shape[0])
    return y + bias.repeat_interleave(groups.counts, dim=0, output_size=y.shape[0])


@dataclass
class AdapterRows:
    """The sorted rows one adapter applies to (``index`` None: all of them), grouped by expert."""

    slot: int
    index: torch.Tensor | None
    groups: ExpertGroups


@dataclass
class JointAdapterRows:
    """Several adapters' rows, adapter after adapter, each adapter's sorted by expert: one grouped
    shrink and one grouped expand over every (adapter, expert) group serve them all, where the
    grouped matmul runs (else each adapter's rows on their own, :meth:`parts`)."""

    slots: list[int | None]  # each part's adapter (None: rows of no adapter, a zero group)
    index: torch.Tensor  # the sorted rows of every part, in order
    offsets: torch.Tensor  # int32 end row (within ``index``) of each (adapter, expert) group
    split: Callable[[], list[AdapterRows]]  # the parts on their own (may read the device: not the fast path)
    _parts: list[AdapterRows] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, parts: list[AdapterRows]) -> JointAdapterRows:
        index = torch.cat([p.index for p in parts])  # type: ignore[misc]
        counts = torch.cat([p.groups.counts for p in parts])
        return cls([p.slot for p in parts], index, torch.cumsum(counts, 0, dtype=torch.int32), lambda: parts)

    def parts(self) -> list[AdapterRows]:
        """Each adapter's rows on its own (computed once, for the layer's three projections)."""
        if self._parts is None:
            self._parts = self.split()
        return self._parts


@dataclass
class BankRows:
    """The decode path: each sorted row's bank row (``position * experts + expert``; -1: no adapter)."""

    rows: RowSlots
    index: torch.Tensor


class ExpertLinear(nn.Module):
    """``num_experts`` stacked projections (weight: experts x out x in), each with per-adapter LoRA."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features), requires_grad=False)
        # Per-expert biases (gpt-oss): frozen, never an adapter's part.
        self.bias = nn.Parameter(torch.empty(num_experts, out_features), requires_grad=False) if bias else None
        self.adapters: dict[int, LoraWeights] = AdapterSlots()
        self._bank: LoraBank | None = None

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.num_experts, rank, self.in_features), (self.num_experts, self.out_features, rank)

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        """Per-expert A ~ kaiming-uniform (as peft does), B = 0 so the adapter starts as a no-op."""
        w = new_lora_weights(*self.lora_shapes(rank), self.in_features, alpha / rank, generator, self.weight.device)
        self.adapters[slot] = w
        return w

    def remove_adapter(self, slot: int) -> None:
        self.adapters.pop(slot, None)

    def merged_weight(self, slot: int) -> torch.Tensor:
        """W + scale * B A per expert, for export (fp32)."""
        w = self.adapters[slot]
        return self.weight.float() + w.scale * torch.bmm(w.B.detach().float(), w.A.detach().float())

    def bank(self, rows: RowSlots) -> LoraBank:
        """Every adapter's per-expert A/B stacked at ``rows.table``'s positions, brought up to date."""
        bank = self._bank
        w = self.weight
        if bank is None or bank.device != w.device or bank.dtype != w.dtype:
            bank = self._bank = LoraBank(self.num_experts, self.in_features, self.out_features, w.device, w.dtype)
        bank.sync(self.adapters, rows.table)
        return bank

    def forward(self, x: torch.Tensor, groups: ExpertGroups, lora: list[AdapterRows] | list[BankRows]) -> torch.Tensor:
        """``x``: rows sorted by expert. Adds ``scale * (x A_e^T) B_e^T`` on each adapter's rows."""
        return self.add_lora(x, add_expert_bias(grouped_linear(x, self.weight, groups), self.bias, groups), lora)

    def add_lora(self, x: torch.Tensor, y: torch.Tensor,
                 lora: list[AdapterRows | JointAdapterRows] | list[BankRows] | list[AdapterRows]) -> torch.Tensor:
        """``y`` plus the adapters' deltas; in place when no graph is recorded (``y`` may then be a
        view, e.g. this projection's columns of a packed gate/up output)."""
        for rows in lora:
            if isinstance(rows, JointAdapterRows):
                delta = self._joint_delta(x, rows)
                if delta is None:  # no grouped matmul here: each adapter on its own
                    y = self.add_lora(x, y, rows.parts())
                elif torch.is_grad_enabled():
                    y = y.index_add(0, rows.index, delta)
                else:
                    y.index_add_(0, rows.index, delta)
                continue
            if isinstance(rows, BankRows):
                if not self.adapters:
                    continue
                bank = self.bank(rows.rows)
                if bank.rank:
                    y = y.clone() if torch.is_grad_enabled() else y
                    expand(y, shrink(x, bank.A, rows.index), bank.B, rows.index)
                continue
            w = self.adapters.get(rows.slot)
            if w is None:
                continue
            A, B = (w.A, w.B) if w.A.dtype == x.dtype else (w.A.to(x.dtype), w.B.to(x.dtype))
            xr = x if rows.index is None else x.index_select(0, rows.index)
            delta = grouped_linear(grouped_linear(xr, A, rows.groups), B, rows.groups) * w.scale
            if torch.is_grad_enabled():
                y = y + delta if rows.index is None else y.index_add(0, rows.index, delta)
            elif rows.index is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows.index, delta)
        return y

    def _joint_delta(self, x: torch.Tensor, rows: JointAdapterRows) -> torch.Tensor | None:
        """``scale * (x A_e^T) B_e^T`` of every part's rows, one grouped matmul pair for all: the
        parts' per-expert A and B stacked (ranks zero-padded to a multiple of 8, the scale folded
        into B, a part whose adapter has no weights here a zero group). Gradients flow back through
        the stack to each adapter's own tensors. None where the grouped matmul does not run."""
        weights = [None if slot is None else self.adapters.get(slot) for slot in rows.slots]
        present = [w for w in weights if w is not None]
        if not present:
            return None
        rank = -(-max(w.A.shape[1] for w in present) // 8) * 8
        if len(weights) * self.num_experts > MAX_GROUPS or not (grouped_mm_fits(x, x.dtype, rank, self.in_features) and grouped_mm_fits(x, x.dtype, self.out_features, rank)):
            return None
        A, B = stack_lora(weights, rank, x.dtype, self.in_features, self.out_features, self.num_experts)
        h = torch._grouped_mm(x.index_select(0, rows.index), A.transpose(1, 2), offs=rows.offsets)
        return torch._grouped_mm(h, B.transpose(1, 2), offs=rows.offsets)


class PackedGateUp:
    """The experts' gate and up weights as two halves of one (experts x 2I x in) buffer.

    Like :class:`tinsmith.models.lora.PackedProjection` for dense layers: the two projections
    stay separate parameters (and LoRA targets) whose weights are views of the buffer, and
    inference runs both as one grouped matmul. A deep copy or a reassigned weight breaks the
    link (``intact`` turns false) and the projections then run separately.
    """

    def __init__(self, gate: ExpertLinear, up: ExpertLinear, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.gate, self.up, self.activation = gate, up, activation
        n = gate.out_features
        self.weight = torch.cat((gate.weight.detach(), up.weight.detach()), dim=1)
        gate.weight = nn.Parameter(self.weight[:, :n], requires_grad=gate.weight.requires_grad)
        up.weight = nn.Parameter(self.weight[:, n:], requires_grad=up.weight.requires_grad)
        self._pointers = self._current_pointers()

    def _current_pointers(self) -> tuple[int, int]:
        return self.gate.weight.data_ptr(), self.up.weight.data_ptr()

    def intact(self) -> bool:
        return self._current_pointers() == self._pointers

    def project(self, x: torch.Tensor, groups: ExpertGroups, lora: list[AdapterRows] | list[BankRows]) -> torch.Tensor:
        """``silu(gate) * up`` of expert-sorted rows (inference only)."""
        n = self.gate.out_features
        y = grouped_linear(x, self.weight, groups)
        if self.gate.bias is not None:
            y = add_expert_bias(y, torch.cat((self.gate.bias, self.up.bias), dim=1), groups)
        g, u = y[:, :n], y[:, n:]
        self.gate.add_lora(x, g, lora)
        self.up.add_lora(x, u, lora)
        return self.activation(g, u)


class Experts(nn.Module):
    """The experts of one layer; ``experts.gate_proj`` etc. are the LoRA target names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None
        e, h, i, bias = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size, cfg.moe.expert_bias
        self.gate_proj = ExpertLinear(e, h, i, bias)
        self.up_proj = ExpertLinear(e, h, i, bias)
        self.down_proj = ExpertLinear(e, i, h, bias)
        self.packed_gate_up: PackedGateUp | None = None  # set by ``pack_weights``
        m = cfg.moe
        self.activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            (lambda g, u: clamped_swiglu(g, u, m.swiglu_alpha, m.swiglu_limit)) if m.activation == "clamped_swiglu"
            else silu_glu)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class TopKRouter(nn.Module):
    """transformers' ``Qwen3MoeTopKRouter`` or, with ``softmax_after_topk``, ``GptOssTopKRouter``
    (biased logits, softmax over the top-k only): frozen, never trained (no load-balancing loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None
        self.top_k = cfg.moe.num_experts_per_tok
        self.norm_topk_prob = cfg.moe.norm_topk_prob
        self.softmax_after_topk = cfg.moe.softmax_after_topk
        self.weight = nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.moe.num_experts), requires_grad=False) if cfg.moe.router_bias else None

    def forward(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights in ``x2``'s dtype, expert indices), both (rows, top_k)."""
        logits = F.linear(x2, self.weight, self.bias)
        if self.softmax_after_topk:
            top_logit, top_index = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top_logit, dim=1, dtype=top_logit.dtype), top_index
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return top_value.to(logits.dtype), top_index


class SparseMoeBlock(nn.Module):
    """Router + experts, in place of a dense MLP (module names as transformers': ``gate`` or
    ``router`` as the family's checkpoints say, and ``experts``)."""

    # The first of the experts this block computes. A block holds every expert (the default) or,
    # under expert parallelism, a contiguous range of them (``experts.*.num_experts`` long): the
    # router still scores every expert, the block runs the (token, expert) pairs of its own
    # range, and its output is this range's share of each token's sum, to be summed over ranks.
    expert_start: int = 0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.moe is not None
        self.router_name = cfg.moe.router_name
        self.add_module(self.router_name, TopKRouter(cfg))
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | RowSlots | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        router: TopKRouter = getattr(self, self.router_name)
        weights, chosen = router(x2)
        flat = chosen.reshape(-1)  # pair p = token * top_k + k
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, router.weight.shape[0])
        ex = self.experts
        num_experts = ex.gate_proj.num_experts
        mine = None  # under expert parallelism, which kept pairs are this block's (None: all of them)
        if num_experts == counts.shape[0]:
            groups, sorted_experts = ExpertGroups(counts), flat[order]
        elif self._keeps_every_pair(x2):
            order, groups, sorted_experts, mine = self._own_pairs_first(flat, counts, num_experts)
        else:  # this block's range of experts: its pairs are one contiguous run of the sorted pairs
            order, groups = self._own_pairs(order, counts, num_experts)
            sorted_experts = flat[order] - self.expert_start
        token_of = order // router.top_k
        lora = _adapter_rows(segments, x2.shape[0], token_of, sorted_experts, num_experts, groups,
                             router.top_k if num_experts == counts.shape[0] else None, mine,
                             grouped_mm_usable(x2, ex.gate_proj.weight))
        rows = x2.index_select(0, token_of)
        packed = ex.packed_gate_up
        if packed is not None and not torch.is_grad_enabled() and packed.intact():
            h = packed.project(rows, groups, lora)
        else:
            h = ex.activation(ex.gate_proj(rows, groups, lora), ex.up_proj(rows, groups, lora))
        out = ex.down_proj(h, groups, lora) * weights.reshape(-1)[order, None]
        if mine is not None:  # the other ranks' pairs: computed by no group, undefined
            out = torch.where(mine[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        # index_add over rows sorted by expert sums each token's experts in ascending expert order.
        return torch.zeros_like(x2).index_add(0, token_of, out).view(x.shape)

    def _keeps_every_pair(self, x: torch.Tensor) -> bool:
        """Whether this block, a range of the experts, keeps every routed pair rather than cutting
        out its own (which reads where they start from the device, once per layer): when the
        grouped matmul computes only the groups it is given (the others' pairs then cost a gather,
        not a matmul; adapters run over every pair, the others' in a zero group), and no gradient
        is recorded (a backward would keep every pair's rows, not this range's, for every layer)."""
        return not torch.is_grad_enabled() and grouped_mm_usable(x, self.experts.gate_proj.weight)

    def _own_pairs_first(self, flat: torch.Tensor, counts: torch.Tensor, num_experts: int
                         ) -> tuple[torch.Tensor, ExpertGroups, torch.Tensor, torch.Tensor]:
        """Every pair, sorted with the experts renumbered from ``expert_start`` (so this block's
        range comes first, in order, and the others' pairs after it): the order, this range's
        groups (the rest counted apart), each sorted pair's renumbered expert, and which are this
        block's. Nothing is read from the device."""
        mine_first = (flat - self.expert_start) % counts.shape[0]
        order = torch.argsort(mine_first, stable=True)
        sorted_experts = mine_first[order]
        own = counts[self.expert_start: self.expert_start + num_experts]
        groups = ExpertGroups(own, rest=counts.sum() - own.sum())
        return order, groups, sorted_experts, sorted_experts < num_experts

    def _own_pairs(self, order: torch.Tensor, counts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ExpertGroups]:
        """The sorted pairs of experts ``expert_start ..`` (``num_experts`` of them), and their groups.
        Where the run starts is read from the host (one read per layer): the slice needs it."""
        host = counts.tolist()
        start, stop = self.expert_start, self.expert_start + num_experts
        lo = sum(host[:start])
        hi = lo + sum(host[start:stop])
        return order[lo:hi], ExpertGroups(counts[start:stop], _host=host[start:stop])


def _adapter_rows(segments: Segments | RowGroups | RowSlots | None, num_tokens: int, token_of: torch.Tensor,
                  sorted_experts: torch.Tensor, num_experts: int, all_groups: ExpertGroups,
                  top_k: int | None = None, mine: torch.Tensor | None = None, grouped: bool = False
                  ) -> list[AdapterRows] | list[JointAdapterRows] | list[BankRows]:
    """Which sorted rows each adapter in ``segments`` owns (rows stay sorted by expert).

    ``top_k``: the pairs per token when the rows are every token's pairs (not one rank's range
    of experts): then each adapter's number of rows is known on the host (its tokens times
    ``top_k``), and its rows are a slice of the rows sorted by adapter, found without reading
    anything back from the device (one read per adapter and layer would stall a GPU's queue).
    Without it (one rank's range of experts), each adapter's number of rows is known on the
    device only: where the grouped matmul runs (``grouped``), the adapters' groups are sized
    there and nothing is read; elsewhere each adapter's rows are found by one read each."""
    if not segments:
        return []
    if isinstance(segments, RowSlots):  # no host read: every row's bank row, as a tensor
        pos = segments.idx.index_select(0, token_of)
        use = pos >= 0 if mine is None else (pos >= 0) & mine  # (another rank's pair: no adapter here)
        return [BankRows(segments, torch.where(use, pos * num_experts + sorted_experts, -1))]
    if len(segments[0]) == 3 and len(segments) == 1:
        slot, a, b = segments[0]  # type: ignore[misc]
        if slot is None:
            return []
        if a == 0 and b == num_tokens:
            return [AdapterRows(slot, None, all_groups)]
    owner = torch.full((num_tokens,), -1, dtype=torch.long, device=token_of.device)
    slots: list[int] = []
    for seg in segments:
        slot = seg[0]
        if slot is None:
            continue
        if len(seg) == 3:
            owner[seg[1]:seg[2]] = len(slots)  # type: ignore[misc]
        else:
            owner[seg[1]] = len(slots)  # type: ignore[misc]
        slots.append(slot)
    pair_owner = owner[token_of]
    if mine is not None:  # another rank's pair: no adapter here
        pair_owner = torch.where(mine, pair_owner, -1)
        sorted_experts = torch.where(mine, sorted_experts, 0)
    out = []
    if top_k is None:  # a range of experts: how many of its pairs each adapter owns is known on the device only
        per = MAX_GROUPS // num_experts - 1  # adapters per grouped call, beside the zero group
        if not slots or not grouped or per < 1:
            return _rows_of(pair_owner, sorted_experts, slots, num_experts)() if slots else []
        # One grouped shrink and expand over every (owner, expert) group, sizes left on the device:
        # rows sorted by owner (stable, so each owner's stay sorted by expert), the rows of no
        # adapter (owner -1) first as a zero group. Past MAX_GROUPS, the adapters are taken a
        # chunk at a time, the other chunks' rows in the zero group.
        joint = []
        for lo in range(0, len(slots), per):
            chunk = slots[lo: lo + per]
            mine_here = (pair_owner >= lo) & (pair_owner < lo + len(chunk))
            local = torch.where(mine_here, pair_owner - lo, -1)
            index = torch.sort(local, stable=True).indices
            counts = expert_counts((local + 1) * num_experts + sorted_experts, (len(chunk) + 1) * num_experts)
            joint.append(JointAdapterRows([None, *chunk], index, torch.cumsum(counts, 0, dtype=torch.int32),
                                          _rows_of(local, sorted_experts, chunk, num_experts)))
        return joint
    tokens = [seg[2] - seg[1] if len(seg) == 3 else seg[1].numel() for seg in segments if seg[0] is not None]  # type: ignore[misc, union-attr]
    by_adapter = torch.sort(pair_owner, stable=True).indices  # tokens of no adapter (-1) first; each adapter's rows in order
    lo = (num_tokens - sum(tokens)) * top_k
    for slot, n in zip(slots, tokens):
        if n:
            index = by_adapter[lo: lo + n * top_k]
            out.append(AdapterRows(slot, index, ExpertGroups(expert_counts(sorted_experts.index_select(0, index), num_experts))))
        lo += n * top_k
    per = max(1, MAX_GROUPS // num_experts)  # adapters per grouped call
    chunks = [out[i: i + per] for i in range(0, len(out), per)]
    return [JointAdapterRows.of(c) if len(c) > 1 else c[0] for c in chunks]


def _rows_of(owner: torch.Tensor, sorted_experts: torch.Tensor, slots: list[int], num_experts: int
             ) -> Callable[[], list[AdapterRows]]:
    """Each of ``slots``' rows on its own (``owner``: each sorted row's index in ``slots``, -1 for
    none), found when asked (one read per adapter: off the grouped matmul only)."""
    def split() -> list[AdapterRows]:
        parts = []
        for i, slot in enumerate(slots):
            index = (owner == i).nonzero().squeeze(1)  # reads the device, once per adapter
            if index.numel():
                parts.append(AdapterRows(slot, index, ExpertGroups(expert_counts(sorted_experts.index_select(0, index), num_experts))))
        return parts
    return split


# ----------------------------------------------------------------------------- checkpoint layouts
# Hub checkpoints (and transformers' save_pretrained) store one tensor per expert,
# ``mlp.experts.{e}.gate_proj.weight``; transformers 5 models hold them fused in memory,
# ``mlp.experts.gate_up_proj`` (experts x 2I x H, gate rows first) and ``mlp.experts.down_proj``.
# Both are read; exports are written per expert, which every version of transformers loads.
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_tensor_sources(name: str, num_experts: int,
                          available: Container[str]) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
    """How to build our stacked expert weight ``name`` from a checkpoint's tensors: (source names,
    combine), or None when ``name`` is not an expert weight or the checkpoint lacks its sources."""
    m = _STACKED.match(name)
    if m is None:
        return None
    prefix, proj = m.groups()
    per_expert = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
    if all(k in available for k in per_expert):
        return per_expert, torch.stack
    fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
    if fused not in available:
        return None
    if proj == "down_proj":
        return [fused], lambda ts: ts[0]
    first = proj == "gate_proj"
    return [fused], lambda ts: (ts[0][:, : ts[0].shape[1] // 2] if first else ts[0][:, ts[0].shape[1] // 2 :]).contiguous()


def split_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our stacked expert weights (and per-expert LoRA tensors) under per-expert Hugging Face names.

    ``...mlp.experts.gate_proj.weight`` (experts x out x in) becomes ``...mlp.experts.{e}.gate_proj.weight``;
    ``...mlp.experts.gate_proj.lora_A.weight`` becomes ``...mlp.experts.{e}.gate_proj.lora_A.weight``
    (the layout peft converts onto transformers 5's fused experts). Other tensors pass through.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _STACKED_ANY.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, proj, suffix = m.groups()
        for e in range(t.shape[0]):
            out[f"{prefix}.{e}.{proj}.{suffix}"] = t[e].clone()  # safetensors refuses shared storage
    return out


def stack_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_expert_tensors` (per-expert names back to stacked tensors)."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, e, proj, suffix = m.groups()
        pieces.setdefault(f"{prefix}.{proj}.{suffix}", {})[int(e)] = t
    for name, by_expert in pieces.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            from tinsmith.errors import InvalidInputError

            raise InvalidInputError(f"tensor {name!r}: experts {sorted(by_expert)} are not 0..{len(by_expert) - 1}")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


_STACKED_ANY = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.((?:lora_[AB]\.)?weight)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.((?:lora_[AB]\.)?weight)$")
