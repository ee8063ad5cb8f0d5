"""Dimuon on an adapter whose factors are split over the ranks of a tensor-parallel group.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tinsmith.optim.dimuon import Dimuon, matrix_direction
from tinsmith.parallel.group import TPGroup
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
