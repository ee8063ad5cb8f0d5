"""Linear layers that carry many LoRA adapters at once.

A batch is laid out so that all rows (tokens) of one adapter are contiguous; the caller
passes ``segments`` — ``(slot, start, end)`` triples over the flattened leading dimension —
and each layer runs one big base matmul plus one small ``x @ A.T @ B.T`` per segment.
Each adapter owns its own ``A`` (rank x in) and ``B`` (out x rank) tensors, sized to its own
rank, so optimizer state is sized to that rank and one adapter's update can never touch
another's weights.

Decode batches, whose rows each read their own adapter, pass :class:`RowSlots` instead: the
layer then runs one gathered shrink/expand over a stacked copy of its adapters
(:mod:`tinsmith.models.lora_bank`, :mod:`tinsmith.kernels.lora_gather`), whatever the number
of adapters in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from tinsmith.models.grouped_lora import dense_lora_add, grouped_lora_delta, multi_lora_path
from tinsmith.models import lora_function
from tinsmith.models.lora_function import compute_copies, lora_group, lora_linear
from tinsmith.models.lora_tenants import (TenantStack, tenants_group, tenants_group_applied, tenants_linear,
                                          tenants_linear_applied)
from tinsmith.models.lora_bank import (AdapterSlots, LoraBank, PendingExpand, RowSlots, Unexpanded,
                                       add_bank_delta_)
from tinsmith.kernels import lora_segments, skinny_matmul
from tinsmith.kernels.lora_gather import triton_usable
from tinsmith.transfers import to_device

# (adapter slot or None for "base model only", start row, end row) over the flattened rows.
Segments = list[tuple[int | None, int, int]]
# Inference-only alternative: (adapter slot, LongTensor of row indices) for rows that are not
# contiguous (a decode batch whose rows come and go); applied with an in-place index_add.
RowGroups = list[tuple[int, torch.Tensor]]

# How decode batches that mix adapters apply them: "bank" (gathered ops over stacked banks, the
# Triton kernels on CUDA), "grouped" (RowGroups: one small matmul pair per adapter), or "auto":
# bank on CUDA; on CPU bank from CPU_BANK_MIN_ADAPTERS adapters in the batch, grouped below,
# where bench/lora_decode_micro.py measures the grouped path faster (the torch gather copies
# every row's A and B; a few adapters' matmuls cost less).
DECODE_LORA = "auto"
CPU_BANK_MIN_ADAPTERS = 32


def decode_rows(model: nn.Module, slots: list[int | None], device: torch.device) -> Segments | RowGroups | RowSlots | None:
    """How a decode batch whose row ``i`` reads adapter ``slots[i]`` (None: none) is passed to the model.

    Rows of a single adapter make one plain segment (a dense GEMM beats any gather); rows of
    several go as :class:`RowSlots` (bank path) or :data:`RowGroups`, as :data:`DECODE_LORA` says.
    """
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s is not None:
            by_slot.setdefault(s, []).append(i)
    if not by_slot:
        return None
    if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(slots):
        return [(next(iter(by_slot)), 0, len(slots))]
    mode = DECODE_LORA
    if mode == "auto":
        cuda = torch.device(device).type == "cuda"
        mode = "bank" if cuda or len(by_slot) >= CPU_BANK_MIN_ADAPTERS else "grouped"
    if mode == "bank":
        return RowSlots.of(model, slots, device)
    return [(s, to_device(ix, device, torch.long)) for s, ix in by_slot.items()]


@dataclass
class LoraWeights:
    A: torch.Tensor  # (rank, in_features), trainable leaf
    B: torch.Tensor  # (out_features, rank), trainable leaf
    scale: float
    # (key, A, B) in the compute dtype of a half-precision model (lora_function.compute_copies)
    copies: tuple | None = field(default=None, repr=False, compare=False)
    # (key, stacked A, [B]) of the projections run together with this one's (lora_function.group_copies)
    group: tuple | None = field(default=None, repr=False, compare=False)


def new_lora_weights(a_shape: tuple[int, ...], b_shape: tuple[int, ...], in_features: int, scale: float,
                     generator: torch.Generator, device: torch.device) -> LoraWeights:
    """Fresh adapter weights: A ~ kaiming-uniform over ``in_features`` (as peft does), B = 0 so the
    adapter starts as a no-op. Drawn on the CPU by the CPU generator, so a seed gives the same
    adapter on any device, then moved to ``device``."""
    A = torch.empty(a_shape, dtype=torch.float32, device="cpu")
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) bound
    A.uniform_(-bound, bound, generator=generator)
    B = torch.zeros(b_shape, dtype=torch.float32, device="cpu")
    return LoraWeights(A.to(device).requires_grad_(), B.to(device).requires_grad_(), scale)


class LoraLinear(nn.Module):
    """``y = x W^T (+ b) + sum over segments of scale * x A^T B^T`` (LoRA on selected rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.adapters: dict[int, LoraWeights] = AdapterSlots()
        self._bank: LoraBank | None = None
        # several tenants' adapters stacked for training (lora_tenants.stacked_copies)
        self._tenant_stack: TenantStack | None = None
        # (A side by side, its parts' stacks) of a q/k/v or gate/up group, on its first layer (lora_tenants)
        self._tenant_cat: tuple | None = None

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of an adapter's (A, B) at ``rank``."""
        return (rank, self.in_features), (self.out_features, rank)

    def add_adapter(self, slot: int, rank: int, alpha: float, generator: torch.Generator) -> LoraWeights:
        """Create adapter ``slot``: A ~ kaiming-uniform (as peft does), B = 0 so it starts as a no-op."""
        w = new_lora_weights(*self.lora_shapes(rank), self.in_features, alpha / rank, generator, self.weight.device)
        self.adapters[slot] = w
        return w

    def remove_adapter(self, slot: int) -> None:
        self.adapters.pop(slot, None)
        self.forget_stacked_copies()

    def forget_stacked_copies(self) -> None:
        """Drop the tenants' adapters stacked for a training step: an adapter that leaves the
        layer (removed, parked off the device) must not stay on the device through the stack."""
        self._tenant_stack = self._tenant_cat = None

    def bank(self, rows: RowSlots) -> LoraBank:
        """This layer's adapters stacked at ``rows.table``'s positions, brought up to date."""
        bank = self._bank
        w = self.weight
        if bank is None or bank.device != w.device or bank.dtype != w.dtype:
            bank = self._bank = LoraBank(1, self.in_features, self.out_features, w.device, w.dtype)
        bank.sync(self.adapters, rows.table)
        return bank

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s product with the base weight (and bias): outside autograd, a decode step's few
        rows take the skinny-product kernel where it is on (:mod:`tinsmith.kernels.skinny_matmul`)."""
        return skinny_matmul.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, segments: Segments | RowGroups | RowSlots | None = None) -> torch.Tensor:
        one = self._training_one_adapter(segments)
        if one is not None:  # the common training step: one autograd node for base and adapter
            return lora_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias, one).reshape(
                *x.shape[:-1], self.out_features)
        if not segments or not self.adapters:
            return self.base(x)
        if isinstance(segments, RowSlots):
            bank = self.bank(segments)
            if not bank.rank:
                return self.base(x)
            y, _ = product_with_bank(x.reshape(-1, self.in_features), self.weight.t(), self.bias, bank, segments,
                                     leave=False)
            return y.view(*x.shape[:-1], self.out_features)
        if len(segments[0]) == 2:
            return self._forward_groups(x, self.base(x), segments)  # type: ignore[arg-type]
        x2 = x.reshape(-1, x.shape[-1])
        shape = (*x.shape[:-1], self.out_features)
        weights = [self.adapters.get(s) if s is not None else None for s, _, _ in segments]  # type: ignore[misc]
        starts, ends = [a for _, a, _ in segments], [b for _, _, b in segments]  # type: ignore[misc]
        tiled = starts[0] == 0 and ends[-1] == x2.shape[0] and starts[1:] == ends[:-1]
        path = multi_lora_path(x2, weights, self.out_features) if tiled and len(weights) > 1 else None
        if tiled and path != "dense" and self._training_tenants(weights):  # several tenants as one autograd node
            sizes = tuple(b - a for a, b in zip(starts, ends))
            return tenants_linear(x2, self.weight, self.bias, self, sizes, tuple(weights), path == "grouped").reshape(
                shape)
        if path == "grouped" and not torch.is_grad_enabled():  # a prefill of several adapters' prompts
            sizes = tuple(b - a for a, b in zip(starts, ends))
            return tenants_linear_applied(x2, self.weight, self.bias, self, sizes, tuple(weights)).reshape(shape)
        y = self.base(x)
        if all(w is None for w in weights):
            return y
        y2 = y.reshape(-1, shape[-1])
        if len(weights) == 1:
            return self._add_delta(y2, x2, weights[0]).reshape(shape)
        if path is not None:  # every tenant's shrink and expand together (GPUs; see grouped_lora)
            sizes = [b - a for a, b in zip(starts, ends)]
            if path == "dense":
                return dense_lora_add(y2, x2, weights, sizes, self.out_features).reshape(shape)
            return (y2 + grouped_lora_delta(x2, weights, sizes, self.out_features)).reshape(shape)
        if tiled:
            # Segments tile the rows: ``split`` rather than slicing. The backward of a slice
            # writes its gradient into a zero-filled tensor of the full size, once per segment
            # (k tenants = k full-size fills and adds per layer); split's backward is one cat.
            sizes = [b - a for a, b in zip(starts, ends)]
            xs, ys = x2.split(sizes), y2.split(sizes)
        else:
            xs, ys = [x2[a:b] for a, b in zip(starts, ends)], [y2[a:b] for a, b in zip(starts, ends)]
        pieces = [yp if w is None else self._add_delta(yp, xp, w) for w, xp, yp in zip(weights, xs, ys)]
        return torch.cat(pieces, dim=0).reshape(shape)

    def forward_leaving_expand(self, x: torch.Tensor, segments: Segments | RowGroups | RowSlots | None,
                               leave: bool) -> torch.Tensor | Unexpanded:
        """:meth:`forward`, and with ``leave`` (the caller's next kernel can add a bank's deltas to
        what it reads: a decode step's residual add and norm) the bank's expand left to that kernel
        where it can be (:meth:`fusable_bank`): an :class:`Unexpanded` output then."""
        bank = self.fusable_bank(segments) if leave else None
        if bank is None:
            return self(x, segments)
        y2, pending = product_with_bank(x.reshape(-1, self.in_features), self.weight.t(), self.bias, bank, segments,
                                        leave=True)
        y = y2.view(*x.shape[:-1], self.out_features)
        return y if pending is None else Unexpanded(y, pending)

    def fusable_bank(self, segments: Segments | RowGroups | RowSlots | None) -> LoraBank | None:
        """The bank whose shrink or expand a neighbouring kernel may take (:meth:`forward_leaving_expand`,
        :meth:`forward_from_shrunk`): a decode batch over banks holding some adapter here, outside
        autograd, a plain projection (a subclass's forward of its own, such as a tensor-parallel one
        whose ranks' outputs are summed, keeps both), where the gathered kernels run; None otherwise."""
        if (type(self).forward is not LoraLinear.forward or not isinstance(segments, RowSlots) or not segments
                or not self.adapters or torch.is_grad_enabled() or not triton_usable(self.weight)):
            return None
        bank = self.bank(segments)
        return bank if bank.rank else None

    def forward_from_shrunk(self, x: torch.Tensor, h: torch.Tensor, bank: LoraBank, rows: RowSlots,
                            leave: bool) -> torch.Tensor | Unexpanded:
        """:meth:`forward_leaving_expand` of ``x`` whose shrink through ``bank`` (:meth:`fusable_bank`)
        a kernel already took: ``h`` (rows, R) fp32."""
        y = self.base(x)
        pending = PendingExpand(h, bank.B, rows.idx, bank.h_offsets, None)
        if leave:
            return Unexpanded(y, pending)
        pending.apply_(y.view(-1, self.out_features))
        return y

    def _training_one_adapter(self, segments) -> LoraWeights | None:
        """The adapter when one segment's adapter, being trained, covers the batch and the base
        weights are frozen (a LoRA step of one tenant); else None."""
        if (not segments or isinstance(segments, RowSlots) or len(segments) != 1 or len(segments[0]) != 3
                or not torch.is_grad_enabled() or not lora_function.FUSED_NODES):
            return None
        slot = segments[0][0]
        w = self.adapters.get(slot) if slot is not None else None
        if w is None or not (w.A.requires_grad or w.B.requires_grad) or self.weight.requires_grad:
            return None
        if self.bias is not None and self.bias.requires_grad:
            return None
        return w

    def _training_tenants(self, weights: list[LoraWeights | None]) -> bool:
        """Whether a micro-batch of several segments with ``weights`` runs as one autograd node
        (:mod:`tinsmith.models.lora_tenants`): gradients wanted for an adapter, base frozen."""
        if not torch.is_grad_enabled() or not lora_function.FUSED_NODES or self.weight.requires_grad:
            return False
        if self.bias is not None and self.bias.requires_grad:
            return False
        return any(w is not None and (w.A.requires_grad or w.B.requires_grad) for w in weights)

    def _forward_groups(self, x: torch.Tensor, y: torch.Tensor, groups: RowGroups | RowSlots) -> torch.Tensor:
        shape = y.shape
        self.add_lora_(x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1]), groups)
        return y

    def add_lora_(self, x2: torch.Tensor, y2: torch.Tensor, segments: Segments | RowGroups | RowSlots | None) -> None:
        """Add the adapters' deltas into ``y2`` in place (inference only: no autograd graph).

        ``x2`` (rows, in) and ``y2`` (rows, out) may be views, e.g. one projection's columns of
        a packed q/k/v output. An adapter that does not target this layer (attention-only,
        MLP-only, no unembedding) adds nothing here.
        """
        if not segments or not self.adapters:
            return
        if isinstance(segments, RowSlots):
            bank = self.bank(segments)
            if bank.rank:
                add_bank_delta_(y2, x2, bank, segments)
            return
        if len(segments[0]) == 2:
            for slot, rows in segments:  # type: ignore[misc]
                w = self.adapters.get(slot)
                if w is not None:
                    y2.index_add_(0, rows, self._delta(x2.index_select(0, rows), w))
            return
        for slot, a, b in segments:  # type: ignore[misc]
            w = self.adapters.get(slot) if slot is not None else None
            if w is not None:
                A, B = compute_copies(w, x2.dtype, keep=False)
                y2[a:b].addmm_(F.linear(x2[a:b], A), B.t(), alpha=w.scale)

    @staticmethod
    def _weights_as(w: LoraWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) in ``dtype``: casts autograd follows while gradients are wanted, else the
        adapter's kept compute copies where a trained adapter has them (casts otherwise)."""
        if not torch.is_grad_enabled():
            return compute_copies(w, dtype, keep=False)
        A, B = w.A, w.B
        return (A, B) if A.dtype == dtype else (A.to(dtype), B.to(dtype))

    @staticmethod
    def _delta(x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
        A, B = LoraLinear._weights_as(w, x.dtype)
        return F.linear(F.linear(x, A), B) * w.scale

    @staticmethod
    def _add_delta(y: torch.Tensor, x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
        """``y + scale * (x A^T) B^T`` as one fused GEMM (scale and add in its epilogue)."""
        A, B = LoraLinear._weights_as(w, x.dtype)
        return torch.addmm(y, F.linear(x, A), B.t(), alpha=w.scale)

    def merged_weight(self, slot: int) -> torch.Tensor:
        """W + scale * B A for export (fp32)."""
        w = self.adapters[slot]
        return self.weight.float() + w.scale * (w.B.detach().float() @ w.A.detach().float())


def trained_together(layers: tuple[LoraLinear, ...], x: torch.Tensor,
                     segments: Segments | RowGroups | RowSlots | None, packed: PackedProjection | None = None,
                     side_by_side: bool = False) -> tuple[torch.Tensor, ...] | torch.Tensor | None:
    """The outputs of ``layers`` (projections of the same ``x``: q/k/v, gate/up) computed as one
    autograd node, or None (each layer then runs on its own). Subclasses (tensor-parallel
    layers) do more in their forward and always run on their own.

    - One adapter, being trained, covers the batch on every layer with one scale: one output
      per layer (:func:`lora_group`).
    - Several tenants' segments tile the batch and every layer runs them grouped: the outputs
      side by side, ``(..., sum of outs)``, from one grouped shrink, one grouped expand and,
      through ``packed`` while the layers' weights are its columns, one base GEMM
      (:func:`tinsmith.models.lora_tenants.tenants_group`); split into one view per layer unless
      ``side_by_side`` (a caller that reads the parts side by side: no split, whose backward
      would concatenate the parts' gradients)."""
    if any(type(layer) is not LoraLinear for layer in layers):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    ws = [layer._training_one_adapter(segments) for layer in layers]
    if all(w is not None for w in ws) and len({w.scale for w in ws}) == 1:  # type: ignore[union-attr]
        outs = lora_group(x2, list(layers), ws)
        return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)
    several = _tenants_together(layers, x2, segments)
    if several is None:
        return None
    y = tenants_group(x2, layers, *several, packed=packed)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if side_by_side else y.split([layer.out_features for layer in layers], dim=-1)


def _tenants_together(layers: tuple[LoraLinear, ...], x2: torch.Tensor, segments, training: bool = True
                      ) -> tuple | None:
    """``(sizes, weights per layer)`` when several tenants' segments tile the rows of a training
    micro-batch (``training``; else of a forward without autograd, a sampler's prefill) and every
    layer of the group runs them grouped (:func:`tenants_group`): each segment the same adapter
    (rank, scale) on every layer, or none on all; else None."""
    if training and (not torch.is_grad_enabled() or not lora_function.FUSED_NODES):  # asked first: a forward without autograd
        return None
    if not segments or isinstance(segments, RowSlots) or len(segments) < 2 or len(segments[0]) != 3:
        return None
    starts, ends = [a for _, a, _ in segments], [b for _, _, b in segments]
    if starts[0] != 0 or ends[-1] != x2.shape[0] or starts[1:] != ends[:-1]:
        return None
    weights = tuple(tuple(layer.adapters.get(s) if s is not None else None for s, _, _ in segments)
                    for layer in layers)
    for column in zip(*weights):
        if any(w is None for w in column):
            if any(w is not None for w in column):
                return None
        elif len({(w.scale, w.A.shape[0]) for w in column}) != 1:
            return None
    for layer, ws in zip(layers, weights):
        if training and not layer._training_tenants(list(ws)):
            return None
        if multi_lora_path(x2, list(ws), layer.out_features) != "grouped":
            return None
    return tuple(b - a for a, b in zip(starts, ends)), weights


def together_groups(model: nn.Module) -> list[tuple[LoraLinear, ...]]:
    """The layer groups a training step may run through :func:`trained_together` (each
    attention's q/k/v, each dense MLP's gate/up): what adapters' compute copies are kept for."""
    groups = []
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            layers = tuple(getattr(module, n, None) for n in names)
            if all(type(layer) is LoraLinear for layer in layers):
                groups.append(layers)
    return groups


class PackedProjection:
    """Several projections that read the same input, stored as one ``(in, sum of outs)`` buffer.

    Each layer's ``weight`` parameter becomes a transposed view of its columns of the buffer, so
    training still sees separate layers (and LoRA targets), while inference computes all of them
    with one GEMM: fewer, wider matrix products, which is what small decode batches are bound
    by. The ``(in, out)`` layout also makes ``x @ W`` a plain (non-transposed) GEMM, measured
    ~1.3-1.7x faster than ``x @ W.T`` for a few rows on CPU.
    """

    def __init__(self, layers: list[LoraLinear]):
        self.layers = layers
        ref = layers[0].weight
        n_in, outs = ref.shape[1], [l.out_features for l in layers]
        self.weight = torch.empty(n_in, sum(outs), dtype=ref.dtype, device=ref.device)
        has_bias = [l.bias is not None for l in layers]
        self.bias = torch.zeros(sum(outs), dtype=ref.dtype, device=ref.device) if any(has_bias) else None
        self.columns: list[tuple[int, int]] = []
        self._bank: LoraBank | None = None  # every layer's adapters, for one gathered shrink/expand
        start = 0
        for layer, n in zip(layers, outs):
            cols = slice(start, start + n)
            self.weight[:, cols] = layer.weight.detach().t()
            layer.weight = nn.Parameter(self.weight[:, cols].t(), requires_grad=layer.weight.requires_grad)
            if layer.bias is not None:
                assert self.bias is not None
                self.bias[cols] = layer.bias.detach()
                layer.bias = nn.Parameter(self.bias[cols], requires_grad=layer.bias.requires_grad)
            self.columns.append((start, start + n))
            start += n
        self._pointers = self._current_pointers()

    def _current_pointers(self) -> list[int]:
        return [l.weight.data_ptr() for l in self.layers] + [l.bias.data_ptr() for l in self.layers if l.bias is not None]

    def intact(self) -> bool:
        """True while every layer's parameters are still the views of this buffer.

        A deep copy (full fine-tuning copies the model) or a reassigned parameter breaks the
        link; the layers then run separately, never from stale packed weights.
        """
        return self._current_pointers() == self._pointers

    @property
    def fuses_lora(self) -> bool:
        """True when a bank batch's adapters run as one shrink and one expand over all the layers."""
        return len(self.layers) > 1 and self.intact()

    def bank(self, rows: RowSlots) -> LoraBank:
        """Every layer's adapters stacked at ``rows.table``'s positions (one part per layer)."""
        bank = self._bank
        w = self.weight
        if bank is None or bank.device != w.device or bank.dtype != w.dtype:
            bank = self._bank = LoraBank(1, w.shape[0], [l.out_features for l in self.layers], w.device, w.dtype)
        bank.sync([l.adapters for l in self.layers], rows.table)
        return bank

    def drop_unused_bank(self) -> None:
        """Free the bank once none of the layers holds an adapter."""
        if self._bank is not None and not any(l.adapters for l in self.layers):
            self._bank = None

    def project(self, x2: torch.Tensor, segments: Segments | RowGroups | RowSlots | None) -> torch.Tensor:
        """All projections of ``x2`` (rows, in) side by side, adapters included (inference only).

        A batch over adapter banks takes one shrink for every layer's adapters and one expand
        into the packed output, rather than a pair per layer (q/k/v: two launches, not six).
        Segments of several adapters (a prefill of several tenants' prompts) take one grouped
        shrink and expand for all of them where the grouped matmul runs (GPUs; see
        :func:`tinsmith.models.lora_tenants.tenants_group_applied`), rather than a pair per
        segment and layer (64 adapters' prompts on q/k/v: 3 launches, not 384).
        """
        return self.project_leaving_expand(x2, segments, leave=False)[0]

    def project_leaving_expand(self, x2: torch.Tensor, segments: Segments | RowGroups | RowSlots | None,
                               leave: bool) -> tuple[torch.Tensor, PendingExpand | None]:
        """:meth:`project`, and with ``leave`` (the caller's next kernel can add a bank's deltas to
        what it reads) the bank's expand left to that kernel where it can be: ``(y, pending)``, ``y``
        without the adapters' deltas while ``pending`` is not None (see
        :func:`tinsmith.models.lora_bank.add_bank_delta_`)."""
        if segments and not isinstance(segments, RowSlots) and not torch.is_grad_enabled():  # callers ask intact()
            several = _tenants_together(tuple(self.layers), x2, segments, training=False)
            if several is not None:
                return tenants_group_applied(x2, tuple(self.layers), *several, packed=self), None
        if isinstance(segments, RowSlots) and len(self.layers) > 1:
            bank = self.bank(segments) if any(l.adapters for l in self.layers) else None
            if bank is not None and bank.rank:
                return product_with_bank(x2, self.weight, self.bias, bank, segments, leave)
        y = skinny_matmul.matmul(x2, self.weight, self.bias)
        if segments and not (isinstance(segments, RowSlots) and len(self.layers) > 1):  # banks: none hold an adapter
            for layer, (a, b) in zip(self.layers, self.columns):
                layer.add_lora_(x2, y[:, a:b], segments)
        return y, None


def product_with_bank(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, bank: LoraBank, rows: RowSlots,
                      leave: bool) -> tuple[torch.Tensor, PendingExpand | None]:
    """``x2 @ w (+ bias)`` (``w`` (in, out)) with each row's adapter delta from ``bank``: ``(y,
    pending)`` as :func:`add_bank_delta_` leaves them (``leave``: the expand left to the caller's
    next kernel where it can be). Where the skinny-product kernel and the gathered shrink both run
    and the rows are not taken by tiles, the product and the shrink are one launch
    (:func:`tinsmith.kernels.skinny_matmul.matmul_shrinking`); otherwise the product, then the bank."""
    fused = None
    if rows.tiles is None or lora_segments.GUARD.failed is not None:
        fused = skinny_matmul.matmul_shrinking(x2, w, bias, bank.A, rows.idx)
    if fused is not None:
        y, h = fused
        pending = PendingExpand(h, bank.B, rows.idx, bank.h_offsets, bank.columns if bank.parts > 1 else None)
        if leave:
            return y, pending
        pending.apply_(y)
        return y, None
    y = skinny_matmul.matmul(x2, w, bias)
    return y, add_bank_delta_(y, x2, bank, rows, leave_expand=leave)


def sync_banks(model: nn.Module, rows: RowSlots) -> tuple:
    """Bring every adapter bank a decode step over ``rows`` reads up to date, and say what it reads.

    A replayed CUDA graph runs no Python, so no layer syncs its own bank: this does, for the
    packed projections that fuse their layers' adapters and for every other layer holding
    adapters (layers of a fused pack have no bank of their own). Returns, per bank holder, its
    buffers' addresses and rank (None when it holds no adapter): a graph captured over other
    addresses is stale.
    """
    layout: list[tuple] = []
    fused: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, PackedProjection) and value.fuses_lora:
                fused.update(id(layer) for layer in value.layers)
                if any(layer.adapters for layer in value.layers):
                    bank = value.bank(rows)
                    layout.append((id(value), bank.A.data_ptr(), bank.B.data_ptr(), bank.rank))
                else:
                    layout.append((id(value), None))
    for module in model.modules():
        if id(module) in fused or not hasattr(module, "bank") or not isinstance(getattr(module, "adapters", None), dict):
            continue
        if module.adapters:
            bank = module.bank(rows)
            layout.append((id(module), bank.A.data_ptr(), bank.B.data_ptr(), bank.rank))
        else:
            layout.append((id(module), None))
    return tuple(layout)


def pack_weights(model: nn.Module) -> None:
    """Lay out every decoder layer's projections as :class:`PackedProjection` buffers.

    q/k/v share one buffer and gate/up another (for routed experts too: one stacked buffer); o,
    down and an untied LM head get their own (for the GEMM layout alone). Values are unchanged, only where they live; safe to call again
    (e.g. on a deep copy, which does not keep the views linked).
    """
    for layer in model.model.layers:
        mlp = layer.mlp
        attn = getattr(layer, "self_attn", None)
        linear = getattr(layer, "linear_attn", None)  # Gated DeltaNet: its four input projections share one buffer
        if linear is not None:
            linear.packed_in = PackedProjection([linear.in_proj_qkv, linear.in_proj_z, linear.in_proj_b,
                                                 linear.in_proj_a])
            PackedProjection([linear.out_proj])
        if attn is not None:
            if not attn.output_gate:  # gated queries interleave with their gates: left unpacked
                attn.packed_qkv = PackedProjection([attn.q_proj, attn.k_proj, attn.v_proj])
            PackedProjection([attn.o_proj])
        if hasattr(mlp, "shared_expert"):
            shared = mlp.shared_expert
            shared.packed_gate_up = PackedProjection([shared.gate_proj, shared.up_proj])
        if hasattr(mlp, "experts"):  # routed experts: gate and up halves of one stacked buffer
            from tinsmith.models.moe import PackedGateUp

            mlp.experts.packed_gate_up = PackedGateUp(mlp.experts.gate_proj, mlp.experts.up_proj,
                                                     mlp.experts.activation)
        else:
            mlp.packed_gate_up = PackedProjection([mlp.gate_proj, mlp.up_proj])
            PackedProjection([mlp.down_proj])
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        PackedProjection([model.lm_head])
