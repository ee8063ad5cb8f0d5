"""Dimuon: momentum, damped row/column preconditioning, matrix-sign orthogonalisation.

One step on a matrix parameter ``W`` (m x n) with gradient ``G``::

    M  <- beta1 * M + (1 - beta1) * G                         momentum (EMA of gradients)
    r  =  mean_j M[i, j]^2 / mean(M^2)                         relative row energies   (m,)
    c  =  mean_i M[i, j]^2 / mean(M^2)                         relative column energies (n,)
    X  =  diag(r + damping)^-1/2  M  diag(c + damping)^-1/2    damped two-sided preconditioning
    O  =  NewtonSchulz5(X / ||X||_F)                           ~ U V^T, the matrix sign of X
    D  =  O * sqrt(k) / ||O||_F                                direction with Frobenius norm sqrt(k)
    W  <- W - lr * (k / 32) ** e * D                           rank-corrected step

``k`` is the LoRA rank of the adapter the matrix belongs to (the exact matrix sign of a full-rank
r x n LoRA factor has Frobenius norm sqrt(r), so the rescaling only removes the iteration's
imprecision), or ``min(m, n)`` for a full fine-tune, where there is no rank to correct for
(``e`` is then ignored). The energies are normalised by their mean, so ``damping`` is
dimensionless: large values make the preconditioner uniform (plain Muon), small ones equalise
every row and column. Tensors that are not matrices (biases, norms) take the momentum normalised
to RMS 1, an Adam-sized step. docs/optimizers.md gives the reasons for each choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from tinsmith.types import DimuonParams

NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic: pushes every singular value into ~[0.7, 1.2]
NORM_EPS = 1e-7  # guards the normalisations of an all-zero momentum
RANK_REFERENCE = 32

DEFAULT_BETA1 = DimuonParams.beta1
DEFAULT_DAMPING = DimuonParams.damping
DEFAULT_RANK_LR_CORRECTION_EXPONENT = DimuonParams.rank_lr_correction_exponent


def newton_schulz(x: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Approximate the matrix sign (orthogonal polar factor) of ``x`` in float32: a matrix, or a
    stack of them (``(..., rows, cols)``, each on its own, all in the same batched matmuls).

    Works on the wide orientation so the Gram matrix is the small side squared (r x r for a
    LoRA factor)."""
    a, b, c = NS_COEFFICIENTS
    y = x.float()
    tall = y.shape[-2] > y.shape[-1]
    if tall:
        y = y.mT
    y = y / (torch.linalg.matrix_norm(y, keepdim=True) + NORM_EPS)
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.mT if tall else y


def precondition(m: torch.Tensor, damping: float) -> torch.Tensor:
    """Scale rows and columns of ``m`` (each matrix of a stack on its own) by their damped inverse
    RMS, relative to the matrix's mean energy."""
    sq = m.float().square()
    mean = sq.mean(dim=(-2, -1), keepdim=True) + NORM_EPS * NORM_EPS
    rows = sq.mean(dim=-1, keepdim=True) / mean
    cols = sq.mean(dim=-2, keepdim=True) / mean
    return m.float() * (rows + damping).rsqrt() * (cols + damping).rsqrt()


def matrix_direction(m: torch.Tensor, damping: float, norm: float) -> torch.Tensor:
    """The orthogonalised, preconditioned direction of momentum ``m`` (a matrix, or a stack of
    them: one per routed expert), Frobenius norm ``norm`` each (zero where the momentum is zero:
    nothing to follow yet). Decided on the device: no value is read back."""
    o = newton_schulz(precondition(m, damping))
    fro = torch.linalg.matrix_norm(o, keepdim=True)
    return torch.where(fro > 0, o * (norm / fro), 0.0)


def vector_direction(m: torch.Tensor) -> torch.Tensor:
    """Momentum of a non-matrix tensor normalised to RMS 1 (zero stays zero)."""
    rms = m.float().square().mean().sqrt()
    return torch.where(rms > 0, m.float() / rms, 0.0)


def rank_lr_factor(rank: int | None, exponent: float) -> float:
    """``(rank / 32) ** exponent``; 1 without a LoRA rank or with exponent 0."""
    if rank is None or exponent == 0:
        return 1.0
    return (rank / RANK_REFERENCE) ** exponent


class Dimuon(torch.optim.Optimizer):
    """Dimuon over one trainable unit. Per-group options: ``lr``, ``beta1``, ``damping``,
    ``rank_lr_correction_exponent`` and ``rank`` (the LoRA rank, None for a full fine-tune).

    The only state is ``momentum`` per parameter (same dtype and device as it), so a saved
    state resumes bit for bit."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float = 1e-4, beta1: float = DEFAULT_BETA1,
                 damping: float = DEFAULT_DAMPING,
                 rank_lr_correction_exponent: float = DEFAULT_RANK_LR_CORRECTION_EXPONENT,
                 rank: int | None = None):
        if lr < 0 or not 0 <= beta1 < 1 or not damping > 0 or not math.isfinite(rank_lr_correction_exponent):
            raise ValueError("Dimuon needs lr >= 0, 0 <= beta1 < 1, damping > 0 and a finite exponent")
        defaults = dict(lr=lr, beta1=beta1, damping=damping,
                        rank_lr_correction_exponent=rank_lr_correction_exponent, rank=rank)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer API)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rank = group["rank"]
            lr = group["lr"] * rank_lr_factor(rank, group["rank_lr_correction_exponent"])
            beta1 = group["beta1"]
            matrices: list[tuple[torch.Tensor, torch.Tensor, float]] = []
            vectors: list[tuple[torch.Tensor, torch.Tensor]] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                m = state["momentum"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if p.ndim in (2, 3):  # a matrix, or a stack of them (one per routed expert), batched
                    matrices.append((p, m, math.sqrt(rank if rank is not None else min(p.shape[-2:]))))
                else:
                    vectors.append((p, m))
            for (p, _), d in zip(vectors, self.vector_directions(vectors)):
                p.add_(d.to(p.dtype), alpha=-lr)
            for (p, _, _), d in zip(matrices, self.matrix_directions(matrices, group["damping"])):
                p.add_(d.to(p.dtype), alpha=-lr)
        return loss

    def matrix_directions(self, matrices: list[tuple[torch.Tensor, torch.Tensor, float]],
                          damping: float) -> Iterator[torch.Tensor]:
        """The directions of the (parameter, momentum, Frobenius norm) ``matrices`` of one group,
        in order, each made as it is taken (a full fine-tune never holds them all at once). Each
        is a function of its whole matrix: a parameter split over ranks overrides this
        (:class:`tinsmith.parallel.sharded_dimuon.ShardedDimuon`)."""
        for _, m, norm in matrices:
            yield matrix_direction(m, damping, norm)

    def vector_directions(self, vectors: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[torch.Tensor]:
        """The directions of the (parameter, momentum) ``vectors`` of one group, in order (the
        momentum at RMS 1: the RMS is over the whole tensor)."""
        for _, m in vectors:
            yield vector_direction(m)
