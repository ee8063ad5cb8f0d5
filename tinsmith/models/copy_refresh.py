"""An adapter's compute copies brought up to date after each optimizer step, from lists made once.

A half-precision model's adapters keep fp32 masters and compute with copies in the model's
dtype: each adapter's own (``LoraWeights.copies``, :func:`tinsmith.models.lora_function.compute_copies`),
its q/k/v and gate/up groups' (``LoraWeights.group``), and its rows of several tenants' stacks
(``LoraLinear._tenant_stack``, :func:`tinsmith.models.lora_tenants.stacked_copies`). After every
optimizer step all of them are rewritten by one multi-tensor copy. Working out that copy's
destinations and sources (a view and a detached alias per tensor, fresh copies allocated) took
the host a few milliseconds per step on a 28-layer model while the device waited, once per
tenant: sixteen tenants' steps, sixteen times (docs/performance.md).

:class:`CopyRefresh` keeps those lists. Each refresh first checks that every cache it wrote last
time is still the one there (by identity: anything else that replaced one, such as a stack
rebuilt for another mix of tenants or an adapter parked off the device, makes it work the lists
out again), then copies in place and brings the caches' keys (the masters' version counters) up
to date, so that the forward finds them current.

In place is safe: a micro-batch's backward runs right after its forward, so no copy is saved for
a pending backward when the weights change (and autograd would refuse a saved tensor changed in
place rather than use it).

**One launch or one per tensor.** On a GPU, torch's multi-tensor copy and multiply take a list in
a few launches only when every tensor is dense (and, for a copy, each destination is laid out as
its source, every destination in one dtype and every source in one); a single other tensor sends
the whole list down a path of one kernel per tensor. A q/k/v or gate/up group's several-tenant
``B`` stack is block-diagonal, and each block of it is such a strided view. Mixed into one list
with the rest, five blocks a layer made every tensor of every stepping tenant its own copy (and
every scaled row its own multiply): an H200 spent 10.9 ms of host per tenant on four tenants'
optimizer steps against 3.9 ms for one (docs/performance.md). So the pairs are sorted once, when
the lists are made (:func:`route`): the dense ones go in one multi-tensor call, and the strided
blocks, with their scale, in one launch of :mod:`tinsmith.kernels.block_copy` (on a CPU, the torch
calls: one copy and one multiply each).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from tinsmith.kernels.block_copy import BlockCopies

_copies = operator.attrgetter("copies")
_tenant_stack = operator.attrgetter("_tenant_stack")


def copy_key(w, dtype: torch.dtype) -> tuple:
    """What an adapter's kept compute copies are current for: the dtype, the masters' versions
    (bumped by every in-place update) and storage."""
    return (dtype, w.A._version, w.B._version, w.A.data_ptr(), w.B.data_ptr())


def group_key(ws: list, dtype: torch.dtype) -> tuple:
    """:func:`copy_key` of a group's stacked copies: every part's masters."""
    return (dtype, *((w.A._version, w.B._version, w.A.data_ptr(), w.B.data_ptr()) for w in ws))


def stack_entry(w) -> tuple | None:
    """What a stack's key holds of one segment's adapter: its masters' versions and storage, its scale."""
    return None if w is None else (w.A._version, w.B._version, w.A.data_ptr(), w.B.data_ptr(), w.scale)


def refresh_copies(weights: list, dtype: torch.dtype, groups: list[list] = ()) -> None:
    """Write the masters into the compute copies of ``weights`` (LoraWeights, each on its own) and
    of ``groups`` (lists of LoraWeights run together by :func:`tinsmith.models.lora_function.lora_group`:
    their ``A`` stacked in one buffer), in ``dtype``, at once: one multi-tensor copy (a handful of
    launches on a GPU) instead of a cast per tensor at each layer's forward. Copies that fit are
    written in place; missing ones are made."""
    CopyRefresh({dtype: list(weights)}, {dtype: list(groups)} if groups else {}, []).refresh()


def refresh_stacks(attachments: list) -> None:
    """After an adapter's weights changed (its optimizer step, a loaded state), write them into
    every layer's kept stack that holds them, in place, for all layers at once (one multi-tensor
    copy and one multiply per scale), and bring those stacks' keys up to date: else each layer
    would rebuild its whole stack at its next forward, a few launches per layer and step.
    ``attachments``: (layer, weights) pairs of the adapter."""
    CopyRefresh({}, {}, list(attachments)).refresh()


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps, in some order of its dimensions
    (ATen's "non-overlapping and dense", what a multi-tensor kernel needs)."""
    if t.layout != torch.strided:
        return False
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def laid_out_alike(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst`` and ``src`` have one shape and, over every dimension longer than one, the same strides."""
    return dst.shape == src.shape and all(a == b for a, b, n in zip(dst.stride(), src.stride(), dst.shape) if n != 1)


def route(dst: torch.Tensor, src: torch.Tensor) -> tuple:
    """Which multi-tensor copy the pair joins (see the module's docstring): pairs of one key go
    in one call, and a call of dense pairs laid out alike takes a GPU a few launches."""
    return (dst.device, dst.dtype, src.dtype, dense(dst) and dense(src) and laid_out_alike(dst, src))


def sorted_copies(dst: list[torch.Tensor], src: list[torch.Tensor]) -> dict[tuple, tuple[list, list]]:
    """The pairs ``dst[i] <- src[i]`` by :func:`route`: {key: (destinations, sources)}."""
    runs: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        ds, ss = runs.setdefault(route(d, s), ([], []))
        ds.append(d)
        ss.append(s)
    return runs


def copy_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every pair, the dense ones in one multi-tensor call."""
    for ds, ss in sorted_copies(dst, src).values():
        torch._foreach_copy_(ds, ss)


def refresh_together(refreshes: list["CopyRefresh"]) -> None:
    """Several adapters' refreshes (each adapter's own caches; several tenants' optimizer steps
    taken together) as one multi-tensor copy of the dense pairs and one multiply per scale for all
    of them, then each adapter's strided blocks (:class:`BlockCopies`)."""
    copies: dict[tuple, tuple[list, list]] = {}
    scaled: dict[float, list[torch.Tensor]] = {}
    for r in refreshes:
        r._ready()
        for key, (ds, ss) in r._copies_by_route.items():
            into = copies.setdefault(key, ([], []))
            into[0].extend(ds)
            into[1].extend(ss)
        for key, parts in r._scaled.items():
            scaled.setdefault(key, []).extend(parts)
    for ds, ss in copies.values():
        torch._foreach_copy_(ds, ss)
    for scale, parts in scaled.items():
        torch._foreach_mul_(parts, scale)
    for r in refreshes:
        r._blocks.run()
    for r in refreshes:
        r._write_keys()


@dataclass
class CopyRefresh:
    """One adapter's refresh lists: see the module's docstring. ``alone``: {dtype: [LoraWeights]}
    whose own copies are kept; ``grouped``: {dtype: [[LoraWeights]]} run together (their stacked
    ``A`` and cast ``B`` kept on the first's ``group``); ``linear``: every (LoraLinear, weights) pair
    of the adapter, whose layers may hold several tenants' stacks."""

    alone: dict
    grouped: dict
    linear: list
    # what the last refresh wrote: the caches' tuples, by identity
    _copies: list = field(default_factory=list, repr=False)
    _copy_weights: list = field(default_factory=list, repr=False)
    _groups: list = field(default_factory=list, repr=False)
    _stacks: list = field(default_factory=list, repr=False)
    _held: list = field(default_factory=list, repr=False)  # (a stack's entries, this adapter's segments in it, weights)
    _keyed: list = field(default_factory=list, repr=False)  # every LoraWeights some cache's key reads
    _copies_by_route: dict = field(default_factory=dict, repr=False)  # route -> (destinations, sources), dense pairs
    _scaled: dict = field(default_factory=dict, repr=False)  # scale -> dense stack rows of B
    _blocks: BlockCopies = field(default_factory=lambda: BlockCopies([], [], []), repr=False)  # the strided pairs
    _made: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self._layers = [layer for layer, _ in self.linear]

    def refresh(self) -> None:
        """Write the masters into every compute copy and stack row of this adapter, in place."""
        refresh_together([self])

    def _ready(self) -> None:
        if not (self._made and self._still_mine()):
            self._make()

    def _still_mine(self) -> bool:
        """Whether every cache holds what the last refresh wrote (and no layer gained a stack)."""
        return (all(map(operator.is_, map(_copies, self._copy_weights), self._copies))
                and all(ws[0].group is mine for ws, _, mine in self._groups)
                and all(map(operator.is_, map(_tenant_stack, self._layers), self._stacks)))

    def _make(self) -> None:
        """Work the lists out: reuse each kept copy whose shape and dtype still fit, else allocate."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        self._copy_weights = []
        for dtype, ws in self.alone.items():
            for w in ws:
                if w.A.dtype == dtype and w.B.dtype == dtype:
                    continue
                a, b = _reuse(w.copies, 1, w.A, dtype), _reuse(w.copies, 2, w.B, dtype)
                w.copies = (None, a, b)
                dst += [a, b]
                src += [w.A.detach(), w.B.detach()]
                self._copy_weights.append(w)
        self._groups = []
        for dtype, groups in self.grouped.items():
            for ws in groups:
                A_cat, Bs = _group_buffers(ws, dtype)
                start = 0
                for w, B_c in zip(ws, Bs):
                    r = w.A.shape[0]
                    dst.append(A_cat[start:start + r])
                    src.append(w.A.detach())
                    start += r
                    if B_c is not w.B:  # a cast copy (else the master itself, read as is)
                        dst.append(B_c)
                        src.append(w.B.detach())
                ws[0].group = (None, A_cat, [B_c if B_c is not w.B else w.B.detach() for w, B_c in zip(ws, Bs)])
                self._groups.append((ws, dtype, ws[0].group))
        self._scaled = {}
        strided: list[tuple] = []  # (destination, source, scale or None)
        self._held = []
        for layer, w in self.linear:
            stack = layer._tenant_stack
            held = [] if stack is None else [i for i, x in enumerate(stack.weights) if x is w]
            if held:
                self._held.append((stack.entries, held, w))
            r = w.A.shape[0]
            for i in held:
                B_rows = stack.B[i, :, :r]
                dst.append(stack.A[i, :r])
                src.append(w.A.detach())
                if dense(B_rows):
                    dst.append(B_rows)
                    src.append(w.B.detach())
                    self._scaled.setdefault(float(w.scale), []).append(B_rows)
                else:  # a block of a group's block-diagonal stack
                    strided.append((B_rows, w.B.detach(), float(w.scale)))
        self._stacks = [layer._tenant_stack for layer in self._layers]
        self._copies_by_route = sorted_copies(dst, src)
        for key in [key for key in self._copies_by_route if not key[-1]]:  # any other strided pair, unscaled
            strided += [(d, s, None) for d, s in zip(*self._copies_by_route.pop(key))]
        self._blocks = BlockCopies([d for d, _, _ in strided], [s for _, s, _ in strided],
                                   [scale for _, _, scale in strided])
        keyed = [*self._copy_weights, *(w for ws, _, _ in self._groups for w in ws), *(w for _, _, w in self._held)]
        self._keyed = list({id(w): w for w in keyed}.values())
        self._made = True

    def _write_keys(self) -> None:
        """Each cache's key (stacks: this adapter's entries) from the masters' current versions;
        remember the tuples written. Each adapter weight's versions and storage are read once
        (most weights key two caches: their own copies or group's, and their stack rows), the
        keys then made as :func:`copy_key`, :func:`group_key` and :func:`stack_entry` make them."""
        part = {id(w): (w.A._version, w.B._version, w.A.data_ptr(), w.B.data_ptr()) for w in self._keyed}
        copies = []
        for w in self._copy_weights:
            c = w.copies
            w.copies = c = ((c[1].dtype, *part[id(w)]), c[1], c[2])
            copies.append(c)
        self._copies = copies
        groups = []
        for ws, dtype, mine in self._groups:
            ws[0].group = g = ((dtype, *(part[id(w)] for w in ws)), mine[1], mine[2])
            groups.append((ws, dtype, g))
        self._groups = groups
        # Only this adapter's entries change, in place: re-reading every segment's (or copying
        # them) would make a round of all tenants' steps quadratic in the tenants. The stacks'
        # entry lists were taken when the lists were made (:meth:`_still_mine` holds them current).
        for entries, held, w in self._held:
            entry = (*part[id(w)], w.scale)
            for i in held:
                entries[i] = entry


def _reuse(cached: tuple | None, i: int, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cached[i]`` where it is a tensor like ``master`` in ``dtype``; else a new one."""
    t = cached[i] if cached is not None else None
    if t is not None and t.shape == master.shape and t.dtype == dtype and t.device == master.device:
        return t
    return torch.empty_like(master, dtype=dtype)


def _group_buffers(ws: list, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A group's stacked ``A`` and each part's ``B`` in ``dtype`` (the master itself where it is
    ``dtype`` already): the kept ones where they fit, else new."""
    cached = ws[0].group
    A0 = ws[0].A
    rows = sum(w.A.shape[0] for w in ws)
    A_cat = cached[1] if cached is not None else None
    if A_cat is None or A_cat.shape != (rows, A0.shape[1]) or A_cat.dtype != dtype or A_cat.device != A0.device:
        A_cat = torch.empty(rows, A0.shape[1], dtype=dtype, device=A0.device)
    Bs = []
    for j, w in enumerate(ws):
        if w.B.dtype == dtype:
            Bs.append(w.B)
        else:
            Bs.append(_reuse(cached[2] if cached is not None else None, j, w.B, dtype))
    return A_cat, Bs
