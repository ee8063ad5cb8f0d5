"""A checkpoint's tensors read where they lie: a mapping over safetensors files that reads a
tensor (or some of its rows) only when asked, through the file's memory map.

Loading a training state used to read every file whole into host memory, and under data or
tensor parallelism rank 0 then pickled every tensor to every other rank. A full fine-tune's
state is 16 bytes per parameter (an 8B model: ~128 GB), so eight ranks held eight copies of it.
:class:`StoredTensors` travels to the other ranks as the files' paths (the ranks share the
checkpoints' filesystem, as sharded writes already require), and a rank holding FSDP2 shards
reads only its rows of each tensor (:meth:`StoredTensors.rows`). One process reads the whole
state before replacing any of it (:func:`in_memory`), as before, so a file that cannot be read
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tinsmith.errors import InvalidInputError


class StoredTensors(Mapping):
    """The tensors of several safetensors files (a sharded checkpoint's parts) under their names;
    a name in two files is refused. Shapes come from the files' headers: nothing is read until a
    tensor is asked for. Pickles as the paths and the index."""

    def __init__(self, files: list[Path], where: str = ""):
        self.files = [str(f) for f in files]
        self._file_of: dict[str, int] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for i, f in enumerate(self.files):
            with safe_open(f, "pt") as h:
                for name in h.keys():
                    if name in self._file_of:
                        raise InvalidInputError(f"checkpoint {where!r} holds {name!r} in more than one file")
                    self._file_of[name] = i
                    self._shapes[name] = tuple(h.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read(name, lambda h: h.get_tensor(name))

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` along its first dimension, read alone."""
        return self._read(name, lambda h: h.get_slice(name)[start:stop])

    def _read(self, name: str, read: Callable) -> torch.Tensor:
        """``read`` of the open file holding ``name``; a file gone or damaged since the checkpoint
        was opened is the client's 400, naming it, not a server error."""
        path = self.files[self._file_of[name]]
        try:
            with safe_open(path, "pt") as h:
                return read(h)
        except (OSError, SafetensorError) as exc:
            raise InvalidInputError(f"checkpoint file {path!r} could not be read ({exc})") from None


def shape_of(tensors: Mapping, name: str) -> tuple[int, ...] | None:
    """The shape of tensor ``name`` of ``tensors`` (None when it is not there), without reading a
    stored one."""
    if isinstance(tensors, StoredTensors):
        return tensors.shape(name) if name in tensors else None
    t = tensors.get(name)
    return None if t is None else tuple(t.shape)


def in_memory(tensors: Mapping) -> Mapping:
    """Every tensor of ``tensors`` read now (a stored checkpoint's, each once); others as they are."""
    return {name: tensors[name] for name in tensors} if isinstance(tensors, StoredTensors) else tensors


def rows_of(tensors: Mapping, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of tensor ``name`` (only those read, from a stored one)."""
    if isinstance(tensors, StoredTensors):
        return tensors.rows(name, start, stop)
    return tensors[name][start:stop]
