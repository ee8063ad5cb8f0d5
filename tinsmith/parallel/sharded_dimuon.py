"""Dimuon on tensors split over ranks: an adapter's factors under tensor parallelism
(:class:`ShardedDimuon`), a full fine-tune's FSDP shards (:class:`FsdpDimuon`).

Dimuon's direction is a function of a whole matrix: the row and column energies of its
preconditioner, its Frobenius norm and the Newton-Schulz iteration all mix every entry. A rank
holding the output rows of a column-parallel ``B`` (or the input columns of a row-parallel ``A``)
cannot compute it from its shard. So each step all-gathers the momenta of the split factors (a
LoRA factor is rank x width: small beside the weights), computes every direction on the whole
matrix on every rank, exactly as one process would, and keeps this rank's part. Factors held
whole (the other factor of each pair, their gradients summed over the ranks before the step)
and routed experts split by expert (each expert's matrices whole on one rank) need no gather.
Moonlight's distributed Muon gathers whole matrices the same way; the extra compute of a
rank-sized Newton-Schulz on every rank is small next to the step's collectives.

A full fine-tune's matrices are not small: the Newton-Schulz iteration of a 4096 x 14336 matrix
is about 5 TFLOP in float32, and one process runs it for every matrix of the model. Sharded with
FSDP, each matrix gets an owner rank (the largest first, each onto the rank with the least work
so far): its momentum is gathered to the owner alone, every rank computes the directions of the
matrices it owns at once, and each owner scatters the rows back. So the group shares the
iteration's work (and the memory of the whole matrices) instead of each rank repeating all of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tinsmith.optim.dimuon import Dimuon, matrix_direction, vector_direction
from tinsmith.parallel.group import TPGroup, guarded
from tinsmith.parallel.partition import chunk_rows, longest_first
from tinsmith.parallel.state import GATHER_BUCKET_BYTES, Split, gather_splits, own_part

Matrix = tuple[torch.Tensor, torch.Tensor, float]  # (parameter, momentum, Frobenius norm)


class ShardedDimuon(Dimuon):
    """:class:`Dimuon` over tensors of which some are shards: ``splits`` gives, for each tensor
    of ``params`` in order, how it is split over ``tp``'s ranks (None: held whole)."""

    def __init__(self, params: Iterable[torch.Tensor], splits: Iterable[Split | None], tp: TPGroup, **kwargs):
        params = list(params)
        self.tp = tp
        self.splits = {id(p): s for p, s in zip(params, splits, strict=True)}
        super().__init__(params, **kwargs)

    def gathered(self, p: torch.Tensor) -> Split | None:
        """How ``p`` is split, where its direction needs the other ranks' parts (None: it does not)."""
        split = self.splits.get(id(p))
        if split is None or self.tp.size == 1:
            return None
        dim = split[0] if isinstance(split, tuple) else split
        return None if p.ndim == 3 and dim == 0 else split  # a stack split by expert: each matrix is whole here

    def matrix_directions(self, matrices: list[Matrix], damping: float) -> Iterator[torch.Tensor]:
        i = 0
        while i < len(matrices):
            p, m, norm = matrices[i]
            if self.gathered(p) is None:
                yield matrix_direction(m, damping, norm)
                i += 1
                continue
            run, size = [], 0  # split tensors in a row, gathered by one collective
            while i < len(matrices) and self.gathered(matrices[i][0]) is not None:
                nbytes = matrices[i][1].nbytes * self.tp.size
                if run and size + nbytes > GATHER_BUCKET_BYTES:
                    break
                run.append(matrices[i])
                size += nbytes
                i += 1
            splits = [self.gathered(q) for q, _, _ in run]
            fulls = gather_splits([mom for _, mom, _ in run], splits, self.tp)  # type: ignore[arg-type]
            for (_, _, n), split, full in zip(run, splits, fulls):
                yield own_part(matrix_direction(full, damping, n), split, self.tp)  # type: ignore[arg-type]


class FsdpDimuon(Dimuon):
    """:class:`Dimuon` over FSDP2 shards (DTensors split along dimension 0 over ``dp``): each
    whole matrix's direction is computed once, by its owner rank."""

    def __init__(self, params: Iterable[torch.Tensor], dp: TPGroup, **kwargs):
        self.dp = dp
        super().__init__(params, **kwargs)

    def vector_directions(self, vectors: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[torch.Tensor]:
        if not vectors:
            return
        local = [_local(m).float() for _, m in vectors]
        sq = torch.stack([x.square().sum() for x in local])
        if self.dp.size > 1 and any(isinstance(m, DTensor) for _, m in vectors):
            guarded(self.dp, "Dimuon vector-norm all_reduce", lambda: dist.all_reduce(sq, group=self.dp.group))
        numel = torch.tensor([float(m.numel()) for _, m in vectors], device=sq.device)
        for (p, m), x, rms in zip(vectors, local, (sq / numel).sqrt()):
            yield _like(p, torch.where(rms > 0, x / rms, 0.0)) if isinstance(m, DTensor) else vector_direction(m)

    def matrix_directions(self, matrices: list[Matrix], damping: float) -> Iterator[torch.Tensor]:
        whole = [not _split_rows(m) for _, m, _ in matrices]
        owners = _owners([m.shape for _, m, _ in matrices], whole, self.dp.size)
        fulls: dict[int, torch.Tensor] = {}
        for i, (_, m, _) in enumerate(matrices):  # every rank joins each gather, in order
            if not whole[i]:
                full = _gather_rows(m, owners[i], self.dp)
                if full is not None:
                    fulls[i] = full
        for i, full in fulls.items():  # this rank's share of the work, while the others do theirs
            fulls[i] = matrix_direction(full, damping, matrices[i][2])
        for i, (p, m, norm) in enumerate(matrices):
            if whole[i]:  # held whole here: a stack split by expert, or not sharded at all
                local = _local(m)
                d = matrix_direction(local, damping, norm) if local.numel() else torch.zeros_like(local, dtype=torch.float32)
                yield _like(p, d) if isinstance(m, DTensor) else d
            else:
                yield _like(p, _scatter_rows(fulls.pop(i, None), m, owners[i], self.dp))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's rows) as a DTensor laid out as ``p``."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _split_rows(m: torch.Tensor) -> bool:
    """Whether each matrix of ``m`` is split over the ranks (a 2-D DTensor split by rows; a 3-D
    stack split along dimension 0 holds whole matrices)."""
    if not isinstance(m, DTensor):
        return False
    if len(m.placements) != 1 or not isinstance(m.placements[0], Shard) or m.placements[0].dim != 0:
        raise ValueError(f"Dimuon on FSDP shards expects tensors split along dimension 0, got {m.placements}")
    return m.ndim == 2


def _owners(shapes: list, whole: list[bool], world: int) -> list[int]:
    """The rank that computes each split matrix's direction: the costliest (rows x cols x the
    smaller side, the iteration's work) first, each onto the rank with the least work so far;
    alike on every rank."""
    split = [i for i in range(len(shapes)) if not whole[i]]
    owners = [0] * len(shapes)
    cost = [shapes[i][0] * shapes[i][1] * min(shapes[i][0], shapes[i][1]) for i in split]
    for rank, mine in enumerate(longest_first(cost, world)):
        for j in mine:
            owners[split[j]] = rank
    return owners


def _gather_rows(m: DTensor, dst: int, dp: TPGroup) -> torch.Tensor | None:
    """The whole of ``m`` in float32 on rank ``dst``'s device (None on the others)."""
    rows = chunk_rows(m.shape[0], dp.size)
    local = m.to_local().float()
    padded = local.new_zeros((max(rows), *m.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(dp.size)] if dp.rank == dst else None
    guarded(dp, "Dimuon momentum gather",
            lambda: dist.gather(padded, parts, group=m.device_mesh.get_group(), group_dst=dst))
    return None if parts is None else torch.cat([x[:n] for x, n in zip(parts, rows)])


def _scatter_rows(full: torch.Tensor | None, m: DTensor, src: int, dp: TPGroup) -> torch.Tensor:
    """This rank's rows of ``full`` (given on rank ``src``), sent by ``src``."""
    rows = chunk_rows(m.shape[0], dp.size)
    mine = torch.empty((max(rows), *m.shape[1:]), dtype=torch.float32, device=m.to_local().device)
    chunks = None
    if dp.rank == src:
        assert full is not None
        chunks = []
        for part, n in zip(list(full.split(rows)), rows):
            padded = mine.new_zeros(mine.shape)
            padded[:n] = part
            chunks.append(padded)
    guarded(dp, "Dimuon direction scatter",
            lambda: dist.scatter(mine, chunks, group=m.device_mesh.get_group(), group_src=src))
    return mine[: rows[dp.rank]]
