"""Stacked adapter banks: the inference copy of a layer's adapters that gathered LoRA ops read.

Training keeps each adapter's own leaf tensors (:class:`tinsmith.models.lora.LoraWeights`,
sized to its rank, so optimizer state is too). A decode batch that mixes adapters instead reads
one bank per layer, ``A[positions, r_max, in]`` and ``B[positions, out, r_max]`` (scale folded
into B, ranks zero-padded), so each projection runs one gathered shrink/expand for every
adapter in the batch (:mod:`tinsmith.kernels.lora_gather`).

Positions are shared by all layers of a model (a :class:`SlotTable`), so one per-row index
tensor serves every layer; a layer that an adapter does not target holds zeros at its position.

A bank is refreshed lazily, when a layer is used by a decode batch after something changed.
"Something changed" is one process-wide counter, :func:`adapters_changed`, bumped by every
mutation of a layer's ``adapters`` dict (add, remove, park, unpark, snapshot install) and by
whatever writes adapter weights in place (optimizer steps, state loads); when it moved, a layer
compares each position's weights with what it copied (same tensors, same storage, same
in-place version) and rewrites only the positions that differ. Code that writes adapter
weights in place calls the model's ``weights_changed(slot)``, which bumps the counter too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tinsmith.kernels import lora_segments
from tinsmith.kernels.lora_gather import expand, expand_parts, shrink, triton_usable
from tinsmith.kernels.lora_segments import RowTiles
from tinsmith.transfers import to_device

if TYPE_CHECKING:
    from tinsmith.models.lora import LoraWeights

_epoch = 0
MIN_POSITIONS = 4  # a slot table never shrinks below this many positions


def adapters_changed() -> None:
    """Note that some adapter's weights or some layer's adapter set changed (banks re-check)."""
    global _epoch
    _epoch += 1


def adapters_epoch() -> int:
    return _epoch


class AdapterSlots(dict):
    """A layer's ``{slot: LoraWeights}``; every mutation calls :func:`adapters_changed`."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        adapters_changed()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        adapters_changed()

    def pop(self, *args):  # type: ignore[override]
        adapters_changed()
        return super().pop(*args)

    def popitem(self):
        adapters_changed()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        adapters_changed()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        adapters_changed()

    def setdefault(self, key, default=None):
        adapters_changed()
        return super().setdefault(key, default)


@dataclass
class SlotTable:
    """Bank position of each adapter slot, for all the layers of one model.

    A position is taken when a slot first appears in a decode batch. When every position is
    held, those of slots absent from the new batch are handed out again; when the batch itself
    has more slots than positions, the table doubles (every bank grows at its next use).

    Adapters come and go (runs end, snapshots are dropped), so a burst of many adapters must not
    keep its memory for ever: after adapters changed, :meth:`release` forgets the positions of
    slots that no layer holds any more and, once at most a quarter of the positions are held,
    halves the table (every bank shrinks at its next use). Eviction alone never shrinks it, so a
    full table that rotates its slots reallocates nothing.
    """

    capacity: int = MIN_POSITIONS
    positions: dict[int, int] = field(default_factory=dict)
    version: int = 0  # bumped whenever a position changes hands or the capacity changes
    released_epoch: int = -1  # the adapters epoch :meth:`release` last ran at

    @classmethod
    def of(cls, model: Any) -> SlotTable:
        table = getattr(model, "_lora_slot_table", None)
        if table is None:
            table = cls()
            model._lora_slot_table = table
        return table

    def release(self, model: Any, keep: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Give back what removed adapters held (cheap unless adapters changed since the last call).

        Layers left with no adapter at all drop their banks; positions of slots no layer of
        ``model`` holds are freed; the capacity halves while at most a quarter of it is held.
        Slots in ``keep`` (those of the decode batch being laid out, whose rows may already hold
        their positions) never move: the capacity stays above the highest of their positions, and
        only other slots are moved down into the smaller range.
        """
        if self.released_epoch == _epoch:
            return
        self.released_epoch = _epoch
        live: set[int] = set()
        for module in model.modules():
            adapters = getattr(module, "adapters", None)
            if isinstance(adapters, AdapterSlots):
                live.update(adapters)
                if not adapters and getattr(module, "_bank", None) is not None:
                    module._bank = None
            for value in vars(module).values():  # packed projections' banks (q/k/v, gate/up)
                drop = getattr(value, "drop_unused_bank", None)
                if drop is not None:
                    drop()
        dead = [s for s in self.positions if s not in live]
        for s in dead:
            del self.positions[s]
        capacity = self.capacity
        pinned = max((self.positions[s] for s in keep if s in self.positions), default=-1)
        while capacity > MIN_POSITIONS and 4 * len(self.positions) <= capacity and pinned < capacity // 2:
            capacity //= 2
        if capacity != self.capacity:  # move the slots past the new end into free positions below it
            free = sorted(set(range(capacity)) - set(self.positions.values()))
            for s, p in sorted(self.positions.items(), key=lambda item: item[1]):
                if p >= capacity:
                    self.positions[s] = free.pop(0)
            self.capacity = capacity
            self.version += 1
        elif dead:
            self.version += 1

    def assign(self, slots: set[int]) -> None:
        new = [s for s in slots if s not in self.positions]
        if not new:
            return
        self.version += 1
        while len(slots) > self.capacity:
            self.capacity *= 2
        free = sorted(set(range(self.capacity)) - set(self.positions.values()))
        if len(free) < len(new):  # hand back the positions of slots this batch does not read
            for s in [s for s in self.positions if s not in slots][: len(new) - len(free)]:
                free.append(self.positions.pop(s))
        for s, p in zip(new, free):
            self.positions[s] = p


@dataclass
class RowSlots:
    """Inference rows that each read one adapter: the bank position per row (-1: base model).

    Passed down the model where training passes segments. ``idx`` is built once per row set, so
    a decode step reads no host state per layer beyond the banks' freshness check.
    """

    table: SlotTable
    idx: torch.Tensor  # (rows,) int64 bank position of each row, -1 for none
    slots: tuple[int | None, ...]  # each row's adapter slot, on the host
    # the rows grouped by position for the segmented kernels, where they run (lora_segments.wanted)
    tiles: RowTiles | None = None

    @classmethod
    def of(cls, model: Any, slots: list[int | None], device: torch.device, tiled: bool = True) -> RowSlots:
        """The rows' bank positions (and, where the segmented kernels run and ``tiled``, their
        tiles; a caller keeping them in buffers of its own passes False)."""
        table = SlotTable.of(model)
        batch = {s for s in slots if s is not None}
        table.release(model, keep=batch)
        table.assign(batch)
        positions = [-1 if s is None else table.positions[s] for s in slots]
        idx = to_device(positions, device, torch.long)
        tiles = lora_segments.row_tiles(positions, device) if tiled and lora_segments.wanted(device) else None
        return cls(table, idx, tuple(slots), tiles)

    def __bool__(self) -> bool:
        return any(s is not None for s in self.slots)


def _version(t: torch.Tensor) -> int:
    # Inference tensors keep no version counter; they cannot change outside inference mode and
    # the only ones adapters hold are frozen sampler snapshots.
    return -1 if t.is_inference() else t._version


class _Copied:
    """What a bank position was copied from: it is current while all of these still hold."""

    __slots__ = ("slot", "A", "B", "a_ptr", "b_ptr", "a_ver", "b_ver", "scale")

    def __init__(self, slot: int, w: LoraWeights):
        self.slot, self.scale = slot, w.scale
        self.A, self.B = weakref.ref(w.A), weakref.ref(w.B)
        self.a_ptr, self.b_ptr = w.A.data_ptr(), w.B.data_ptr()
        self.a_ver, self.b_ver = _version(w.A), _version(w.B)

    def matches(self, slot: int, w: LoraWeights) -> bool:
        return (self.slot == slot and self.A() is w.A and self.B() is w.B and self.scale == w.scale
                and self.a_ptr == w.A.data_ptr() and self.b_ptr == w.B.data_ptr()
                and self.a_ver == _version(w.A) and self.b_ver == _version(w.B))


def _copied(slot: int, weights: tuple[LoraWeights | None, ...]) -> tuple[_Copied | None, ...]:
    return tuple(None if w is None else _Copied(slot, w) for w in weights)


def _current(slot: int, weights: tuple[LoraWeights | None, ...], copied: tuple[_Copied | None, ...] | None) -> bool:
    if copied is None:
        return False
    return all((c is None) if w is None else (c is not None and c.matches(slot, w)) for w, c in zip(weights, copied))


class LoraBank:
    """The adapters of one layer, or of several layers that read the same input, stacked by position.

    With ``outs`` = one layer's output size: ``A (positions*experts, r, in)``, ``B
    (positions*experts, out, r)``. Dense layers have one "expert"; row ``p * experts + e`` is
    expert ``e`` of the adapter at position ``p``, so expert layers index it with
    ``position * experts + expert``.

    With several parts (q/k/v, gate/up: a :class:`tinsmith.models.lora.PackedProjection`), one
    shrink and one expand serve them all: part ``j``'s A fills rows ``[j*r, (j+1)*r)`` of ``A
    (positions, parts*r, in)``, its B the part's columns of ``B (positions, sum of outs, r)``, and
    ``h_offsets[column]`` = ``j*r`` says which part of the shrunk vector each output column reads.
    A part an adapter does not target holds zeros.
    """

    def __init__(self, experts: int, in_features: int, outs: int | list[int], device: torch.device,
                 dtype: torch.dtype):
        self.outs = [outs] if isinstance(outs, int) else list(outs)
        self.experts, self.in_features, self.out_features = experts, in_features, sum(self.outs)
        self.device, self.dtype = device, dtype
        self.columns: list[tuple[int, int]] = []
        start = 0
        for n in self.outs:
            self.columns.append((start, start + n))
            start += n
        self.rank = 0
        self.positions = 0
        self.A = torch.zeros(0, 0, in_features, device=device, dtype=dtype)
        self.B = torch.zeros(0, self.out_features, 0, device=device, dtype=dtype)
        self.h_offsets = torch.zeros(self.out_features, dtype=torch.int32, device=device)
        self.copied: list[tuple[_Copied | None, ...] | None] = []
        self.epoch = -1
        self.table_version = -1
        self.adapters_refs: tuple = ()

    @property
    def parts(self) -> int:
        return len(self.outs)

    def sync(self, adapters: dict[int, LoraWeights] | list[dict[int, LoraWeights]], table: SlotTable) -> None:
        """Bring every position of ``table`` up to date with ``adapters`` (one dict per part;
        cheap when nothing changed)."""
        parts = [adapters] if isinstance(adapters, dict) else list(adapters)
        refs = tuple(id(a) for a in parts)
        if self.epoch == _epoch and self.table_version == table.version and self.adapters_refs == refs:
            return
        held = {s: tuple(a.get(s) for a in parts) for s in table.positions if any(s in a for a in parts)}
        rank = max((w.A.shape[-2] for ws in held.values() for w in ws if w is not None), default=0)
        if rank < self.rank:
            # Shrink only to what the layers' adapters could need (held or not): an adapter that
            # merely lost its position to another comes back without a reallocation.
            rank = max(rank, min(self.rank, max((w.A.shape[-2] for a in parts for w in a.values()), default=0)))
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: usable in any mode
            if table.capacity != self.positions or rank != self.rank:
                self._resize(table.capacity, rank)
            for slot, p in table.positions.items():
                ws = held.get(slot)
                if ws is None:
                    if self.copied[p] is not None:
                        self._write(p, None)
                elif not _current(slot, ws, self.copied[p]):
                    self._write(p, ws)
                    self.copied[p] = _copied(slot, ws)
        self.epoch, self.table_version, self.adapters_refs = _epoch, table.version, refs

    def _resize(self, positions: int, rank: int) -> None:
        """New buffers of ``positions`` x ``rank`` (larger or smaller); every position is copied again."""
        e = self.experts
        self.A = torch.zeros(positions * e, self.parts * rank, self.in_features, device=self.device, dtype=self.dtype)
        self.B = torch.zeros(positions * e, self.out_features, rank, device=self.device, dtype=self.dtype)
        self.h_offsets = torch.cat([torch.full((b - a,), j * rank, dtype=torch.int32)
                                    for j, (a, b) in enumerate(self.columns)]).to(self.device)
        self.positions, self.rank = positions, rank
        self.copied = [None] * positions  # everything is copied again

    def _write(self, p: int, weights: tuple[LoraWeights | None, ...] | None) -> None:
        e, R = self.experts, self.rank
        A = self.A.view(self.positions, e, self.parts * R, self.in_features)[p]
        B = self.B.view(self.positions, e, self.out_features, R)[p]
        A.zero_()
        B.zero_()
        self.copied[p] = None
        if weights is None:
            return
        for j, (w, (a, b)) in enumerate(zip(weights, self.columns)):
            if w is None:
                continue
            r = w.A.shape[-2]
            A[:, j * R: j * R + r].copy_(w.A.detach().reshape(e, r, self.in_features))
            B[:, a:b, :r].copy_((w.B.detach().float() * w.scale).reshape(e, b - a, r))


# Which kernels of a decode step take the expand of the bank of the projection whose output they
# read, where they run: "heads" (the kernel turning the q/k heads and storing the keys and values,
# after q/k/v), "silu" (the SiLU product, after gate/up), "norms" (the residual add and norm, after
# o and down). Each is a launch less per projection and step, and the output not written and read
# back once more; a kernel not named leaves the expand to its own launch (benchmarks compare).
EXPANDS_TAKEN: frozenset[str] = frozenset({"heads", "silu", "norms"})


def expands_taken_by(kernel: str) -> bool:
    """Whether ``kernel`` (one of :data:`EXPANDS_TAKEN`'s names) takes its projection's expand."""
    return kernel in EXPANDS_TAKEN


# Which kernels of a decode step take the shrink of the bank of the projection that reads their
# output, where they run: "silu" (the SiLU product takes the down projection's, a partial sum per
# block of its output; :func:`tinsmith.kernels.swiglu.silu_mul_shrinking`).
SHRINKS_TAKEN: frozenset[str] = frozenset({"silu"})


def shrinks_taken_by(kernel: str) -> bool:
    """Whether ``kernel`` (one of :data:`SHRINKS_TAKEN`'s names) takes the next projection's shrink."""
    return kernel in SHRINKS_TAKEN


@dataclass
class PendingExpand:
    """A bank's shrink taken, its expand not yet added into the projection's output ``y``.

    The kernel that reads ``y`` next adds each row's ``B[idx[row]] @ h[row]`` to the values it
    loads, as the expand would have (:func:`tinsmith.kernels.lora_gather.expand_block`: the same
    fp32 sum, rounded once to ``y``'s dtype), so ``y`` itself keeps the base projection alone.
    Whoever holds one and cannot hand it to such a kernel calls :meth:`apply_` before ``y`` is read.
    """

    h: torch.Tensor  # (rows, parts * R) fp32: every part's shrunk vector side by side
    B: torch.Tensor  # the bank's (positions, out, R), scale folded in
    idx: torch.Tensor  # (rows,) bank position of each row, -1 for none
    h_offsets: torch.Tensor  # (out,) int32: where in ``h`` each output column's part starts
    columns: list[tuple[int, int]] | None  # the parts' columns of a packed bank; None for one layer

    def apply_(self, y: torch.Tensor) -> None:
        """Add the deltas into ``y`` in place, by the expand's own launch."""
        if self.columns is None:
            expand(y, self.h, self.B, self.idx)
        else:
            expand_parts(y, self.h, self.B, self.idx, self.columns, self.h_offsets)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h, B, idx, h_offsets)``, what the kernels that take the expand read."""
        return self.h, self.B, self.idx, self.h_offsets


@dataclass
class Unexpanded:
    """A projection's output ``y`` (the base projection alone) and its bank's pending expand: what
    a decode step's o and down projections hand the residual add and norm after them, which add
    the deltas as they load ``y`` (:func:`tinsmith.models.layers.add_rms_norm`). Anything else
    reads :meth:`finished`."""

    y: torch.Tensor
    pending: PendingExpand

    def finished(self) -> torch.Tensor:
        """``y`` with the deltas added (by the expand's own launch)."""
        self.pending.apply_(self.y.view(-1, self.y.shape[-1]))
        return self.y


def finished(t: torch.Tensor | Unexpanded) -> torch.Tensor:
    """``t`` itself, or an :class:`Unexpanded` output with its deltas added."""
    return t.finished() if isinstance(t, Unexpanded) else t


def add_bank_delta_(y: torch.Tensor, x: torch.Tensor, bank: LoraBank, rows: RowSlots,
                    leave_expand: bool = False) -> PendingExpand | None:
    """Add each row's adapter delta from ``bank`` into ``y`` (rows, out) in place, for ``x`` (rows,
    in): one shrink and one expand for every adapter of the batch (and every part of a packed
    bank). By tiles of rows sharing an adapter where the rows carry them and the outputs allow it
    (:mod:`tinsmith.kernels.lora_segments`), else row by row (:mod:`tinsmith.kernels.lora_gather`).

    ``leave_expand`` (the caller's next kernel can add the deltas itself: :func:`expands_taken_by`):
    where the gathered kernels run, only the shrink is taken, and what the expand would add is
    returned instead (``y`` keeps the base projection); otherwise None, ``y`` done."""
    parts = bank.parts > 1
    tiles = rows.tiles
    if leave_expand and triton_usable(y):
        h = None
        if tiles is not None and lora_segments.GUARD.failed is None:
            h = lora_segments.GUARD.call(lora_segments.shrink, x, bank.A, tiles, on=x)
        if h is None:
            h = shrink(x, bank.A, rows.idx)
        return PendingExpand(h, bank.B, rows.idx, bank.h_offsets, bank.columns if parts else None)
    if tiles is not None and lora_segments.GUARD.failed is None:
        block = lora_segments.expand_block(y.shape[1], bank.columns if parts else None, y.device.type == "cpu")
        if block is not None:
            h = lora_segments.GUARD.call(lora_segments.shrink, x, bank.A, tiles, on=x)
            if h is not None and lora_segments.GUARD.ran(lora_segments.expand, y, h, bank.B, tiles,
                                                         bank.h_offsets if parts else None, block, on=y):
                return None
    h = shrink(x, bank.A, rows.idx)
    if parts:
        expand_parts(y, h, bank.B, rows.idx, bank.columns, bank.h_offsets)
    else:
        expand(y, h, bank.B, rows.idx)
    return None
