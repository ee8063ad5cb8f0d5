"""Sharded checkpoint writes: every data-parallel rank writes its own part of one checkpoint.

Gathered to one process, a sharded full fine-tune's checkpoint would need the whole model and
its optimizer state in that process's host memory (a 32B model: ~64 GB of weights and ~256 GB
of fp32 AdamW moments) and one process writing every byte. Instead, as
``torch.distributed.checkpoint`` does, the tensor names are split over the ranks
(:func:`owners_by_bytes`: balanced by bytes, the same on every rank without communicating);
each tensor is gathered to its owner only (``dist.gather``, not an all-gather), and each rank
writes the tensors it owns into its own files inside the checkpoint's temporary directory. Rank
0 then writes the index and commits the directory atomically, so the result is one checkpoint
in the usual formats (:mod:`tinsmith.checkpoints.state_format`, a Hugging Face directory).

:func:`save_sharded` runs on every rank at once (the ranks share the filesystem that holds the
checkpoint). A rank that fails to write fails the save on every rank with the same error (a
:class:`CapacityError` for a disk or permission error), the temporary directory is removed, and
the run is untouched: the group stays in step.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.tensor import DTensor, Shard

from tinsmith.checkpoints.peft_format import atomic_dir
from tinsmith.errors import CapacityError
from tinsmith.parallel.group import TPGroup, guarded
from tinsmith.parallel.partition import chunk_rows, longest_first


@dataclass
class SaveSource:
    """One tensor of the checkpoint: its name and this rank's view of it (a DTensor shard, or a
    tensor every rank holds whole)."""

    name: str
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()  # a DTensor's numel is the full size


@dataclass
class SaveReport:
    """What a sharded save came to on this rank: bytes committed (rank 0's count; 0 elsewhere),
    and the most bytes of full-size tensors the save held at once here."""

    size: int
    peak_bytes: int


def owners_by_bytes(sizes: dict[str, int], world: int) -> dict[str, int]:
    """The rank that writes each tensor: largest first onto the rank with the fewest bytes so far
    (ties: the lower rank; equal sizes in name order). Deterministic, so every rank computes the
    same split; no rank gets more than ``total / world`` plus the largest tensor."""
    names = sorted(sizes)
    shares = longest_first([sizes[n] for n in names], world)
    return {names[i]: r for r, share in enumerate(shares) for i in share}


def gather_to(t: torch.Tensor, dst: int, group: TPGroup, what: str) -> torch.Tensor | None:
    """The whole of ``t`` in host memory on rank ``dst`` (None on the others, which send their
    shard). FSDP2 shards along dimension 0 as ``torch.chunk`` does (the last ranks may hold fewer
    rows, or none); shards are padded to equal size for the collective and trimmed after."""
    if not isinstance(t, DTensor):
        return t.detach().to("cpu", copy=True) if group.rank == dst else None
    if len(t.placements) != 1 or not isinstance(t.placements[0], Shard) or t.placements[0].dim != 0:
        raise ValueError(f"{what}: expected a DTensor sharded along dimension 0, got {t.placements}")
    local = t.to_local().detach()
    world = group.size
    rows = chunk_rows(t.shape[0], world)
    if local.shape[0] != rows[group.rank]:
        raise ValueError(f"{what}: rank {group.rank} holds {local.shape[0]} rows, expected {rows[group.rank]}")
    padded = local.new_zeros((max(rows), *t.shape[1:]))
    padded[: local.shape[0]] = local
    pg = t.device_mesh.get_group()
    parts = [torch.empty_like(padded) for _ in range(world)] if group.rank == dst else None
    guarded(group, f"gather of {what}", lambda: dist.gather(padded, parts, group=pg, group_dst=dst))
    if parts is None:
        return None
    return torch.cat([p[:n] for p, n in zip(parts, rows)]).to("cpu")


def gather_owned(sources: list[SaveSource], owner: dict[str, int], group: TPGroup) -> tuple[dict, int]:
    """Gather every source to its owner, in list order (every rank runs each collective); this
    rank's own tensors, and the most bytes they reached (they are all held until written)."""
    mine: dict[str, torch.Tensor] = {}
    held = 0
    for s in sources:
        full = gather_to(s.tensor, owner[s.name], group, s.name)
        if full is not None:
            mine[s.name] = full
            held += full.numel() * full.element_size()
    return mine, held


def _failure(exc: BaseException) -> tuple[str, str]:
    """(kind, text) of a write failure, alike on every rank it is sent to."""
    if isinstance(exc, OSError):
        return "capacity", exc.strerror or str(exc)
    if isinstance(exc, SafetensorError):  # how safetensors reports a failed write (disk full, file too large)
        return "capacity", str(exc)
    return "error", f"{type(exc).__name__}: {exc}"


def _raise_first(failures: list[tuple[int, tuple[str, str]] | None], what: str) -> None:
    """Raise the lowest failing rank's error (every rank raises the same one)."""
    for item in failures:
        if item is not None:
            rank, (kind, text) = item
            message = f"could not write {what} (rank {rank}): {text}"
            raise CapacityError(message) if kind == "capacity" else RuntimeError(message)


def save_sharded(final: Path, group: TPGroup, sources: list[SaveSource],
                 write_part: Callable[[Path, dict[str, torch.Tensor]], dict[str, Any]],
                 commit: Callable[[Path, dict[str, Any]], int], what: str) -> SaveReport:
    """Write one checkpoint at ``final`` from every rank (all call it, with the same sources in
    the same order). ``write_part(tmp, tensors)`` writes this rank's tensors into ``tmp`` and
    returns what the index needs of them (``{file: info}``); ``commit(tmp, parts)`` runs on rank
    0 with every rank's parts merged, writes the index and commits ``tmp`` as ``final``."""
    box: list = [None]
    if group.rank == 0:
        try:
            box[0] = (str(atomic_dir(Path(final))), None)
        except Exception as exc:
            box[0] = (None, (0, _failure(exc)))
    guarded(group, "checkpoint directory broadcast", lambda: dist.broadcast_object_list(box, src=0, group=group.group))
    tmp_name, failed = box[0]
    if failed is not None:
        _raise_first([failed], what)
    tmp = Path(tmp_name)
    owner = owners_by_bytes({s.name: s.nbytes for s in sources}, group.size)
    try:
        mine, peak = gather_owned(sources, owner, group)
    except BaseException:  # raised alike on every rank (or the group is down): nothing is committed
        if group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    parts, failure = {}, None
    try:
        parts = write_part(tmp, mine)
    except Exception as exc:
        failure = (group.rank, _failure(exc))
    del mine
    reports: list = [None] * group.size
    guarded(group, "checkpoint part exchange",
            lambda: dist.all_gather_object(reports, (parts, failure), group=group.group))
    failures = [f for _, f in reports]
    if group.rank == 0 and any(failures):
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_first(failures, what)
    size, failure = 0, None
    if group.rank == 0:
        merged = {f: info for part, _ in reports for f, info in part.items()}
        try:
            size = commit(tmp, merged)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = (0, _failure(exc))
    box = [failure]
    guarded(group, "checkpoint commit broadcast", lambda: dist.broadcast_object_list(box, src=0, group=group.group))
    _raise_first(box, what)
    return SaveReport(size, peak)
