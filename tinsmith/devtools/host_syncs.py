"""Where a block of torch code would make the host wait for a GPU, found on any device.

On a GPU the host queues kernels and runs ahead. It stops and waits for everything queued
whenever it needs a value computed there (``.item()``, ``.tolist()``, ``bool(t)``, an operator
whose output shape depends on the data, such as ``nonzero``) or copies host memory to the device
without ``non_blocking`` (PyTorch synchronises the stream after such a copy). One of these in a
decode step or a layer's forward drains the launch queue at every call, and the GPU idles while
Python catches up. ``torch.cuda.set_sync_debug_mode`` finds reads on a GPU only, and no copies;
this finds both on a CPU, where the same code runs, so tests hold hot loops to a budget of them
without a GPU:

* ``read`` (device to host): ``Tensor.item / tolist / numpy / cpu / __bool__ / __int__ /
  __float__ / __index__ / __array__`` of a device tensor, and the operators that size their
  output from the data (:data:`DATA_DEPENDENT_OPS`, and indexing by a boolean mask), seen at
  dispatch, so calls from inside torch count too;
* ``copy`` (host to device): ``torch.tensor`` / ``torch.as_tensor`` of Python or NumPy data for
  the device, and ``Tensor.to`` / ``copy_`` of a host tensor onto it; with ``non_blocking`` too
  when the host tensor is pageable (CUDA may wait for the stream before it stages such a copy),
  unless :mod:`tinsmith.transfers` makes it (it stages host data in page-locked memory first).

On a CPU host and device are one, so the mode tells them apart by where tensors come from: a
tensor made from host data (``torch.tensor``, ``torch.as_tensor`` or ``torch.from_numpy`` not
asking for the device) is a host tensor, and so are one made by ``torch.arange``, ``zeros``,
``ones``, ``empty`` or ``full`` without a device (on a GPU it is in host memory too), what
``.cpu()`` returns, and what an operator computes from host tensors alone; every other tensor is
a device tensor, tensors made before the block included, and so is a host tensor moved with
``.to(device)`` (a view of it stands for the copy a GPU would make). A device given as a
``torch.device`` names the device, even the CPU's; only the string ``"cpu"`` names the host.

``with HostSyncs() as h: ...`` then ``h.events`` (kind, what, where: the innermost ``tinsmith``
frame), ``h.count(kind)`` and ``h.by_site()``.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operators whose output size (or a value on the host) depends on the data: on CUDA they copy a
# count or a flag to the host and wait for it.
DATA_DEPENDENT_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.bincount.default, aten.equal.default, aten.is_nonzero.default,
}
_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__")
_FACTORIES = ("arange", "zeros", "ones", "empty", "full")  # made in host memory unless given a device
_HOST = "_tinsmith_host"  # attribute marking a host tensor


@dataclass(frozen=True)
class HostSync:
    kind: str  # "read" (device to host) or "copy" (host to device)
    what: str
    where: str  # path:line of the innermost tinsmith frame that asked for it


def _is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _mark_host(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        setattr(t, _HOST, True)
    return t


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/tinsmith/" in f.filename and not f.filename.endswith("host_syncs.py")]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rsplit('/tinsmith/', 1)[-1]}:{f.lineno}"


class HostSyncs(TorchDispatchMode):
    """Records every point of a block that would synchronise a GPU's stream with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[HostSync] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._inside = 0  # > 0 while a patched call runs: its own inner calls are not counted again

    # ------------------------------------------------------------------ results
    def count(self, kind: str | None = None) -> int:
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    def by_site(self) -> Counter:
        return Counter(f"{e.kind} {e.what} @ {e.where}" for e in self.events)

    # ------------------------------------------------------------------ mode
    def __enter__(self):
        for name in _READS:
            self._patch(torch.Tensor, name, self._reader(name))
        self._patch(torch, "tensor", self._maker("torch.tensor"))
        self._patch(torch, "as_tensor", self._maker("torch.as_tensor"))
        self._patch(torch, "from_numpy", lambda original: lambda a: _mark_host(original(a)))
        for name in _FACTORIES:
            self._patch(torch, name, self._factory)
        self._patch(torch.Tensor, "to", self._mover())
        self._patch(torch.Tensor, "copy_", self._copier())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(_is_host(t) for t in inputs)
        if not self._inside and not any(_is_host(a) for a in args):
            if func in DATA_DEPENDENT_OPS:
                self._record("read", func.overloadpacket.__name__)
            elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
                self._record("read", "boolean mask index")
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self._record("read", "repeat_interleave without output_size")  # sizes its output by the sum
        out = func(*args, **kwargs)
        if on_host and not self._inside:  # computed from host tensors alone: on a GPU it runs on the host too
            for t in pytree.tree_leaves(out):
                _mark_host(t)
        return out

    @staticmethod
    def _factory(original: Callable) -> Callable:
        """``torch.arange`` and kin: a host tensor unless asked for a device (on a GPU, one made
        without ``device`` is in host memory too)."""
        def make(*args, **kwargs):
            out = original(*args, **kwargs)
            return _mark_host(out) if kwargs.get("device") is None or _names_cpu((), kwargs) else out
        return make

    # ------------------------------------------------------------------ patching
    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def _record(self, kind: str, what: str) -> None:
        self.events.append(HostSync(kind, what, _caller()))

    def _counted(self, original: Callable, classify: Callable[..., tuple[str, str] | None],
                 host_result: Callable[..., bool] = lambda *a, **k: False) -> Callable:
        """``original`` with its calls classified (kind, what) before it runs, none of its
        inner calls counted, and its result marked a host tensor where ``host_result`` says."""
        def call(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            found = classify(*args, **kwargs)
            if found:
                self._record(*found)
            self._inside += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside -= 1
            return _mark_host(out) if host_result(*args, **kwargs) else out
        return call

    def _reader(self, name: str) -> Callable[[Callable], Callable]:
        def classify(t, *a, **k):
            if t.device.type == "meta" or _is_host(t) or (name != "cpu" and not t.numel()):
                return None
            if t.dim() == 0 and _in_torch_optim():
                return None  # torch.optim's step counters live on the host (unless capturable)
            return "read", f"Tensor.{name}"
        return lambda original: self._counted(original, classify, lambda *a, **k: name == "cpu")

    def _maker(self, name: str) -> Callable[[Callable], Callable]:
        def classify(data, *a, device=None, **k):
            if device is None or _names_cpu((), {"device": device}) or (
                    isinstance(data, torch.Tensor) and not _is_host(data)):
                return None
            return "copy", name

        def host(data, *a, device=None, **k):
            return ((device is None and (not isinstance(data, torch.Tensor) or _is_host(data)))
                    or _names_cpu((), {"device": device}))
        return lambda original: self._counted(original, classify, host)

    def _mover(self) -> Callable[[Callable], Callable]:
        def target(a, k) -> Any:
            for x in (*a, k.get("device"), k.get("other")):
                if isinstance(x, torch.Tensor):
                    return x
                if isinstance(x, (str, torch.device)):
                    return torch.device(x)
            return None

        def classify(t, *a, **k):
            to = target(a, k)
            if not _is_host(t) or to is None:
                return None
            if isinstance(to, torch.Tensor) and _is_host(to):
                return None
            if isinstance(to, torch.device) and to.type == "cpu" and t.device.type == "cpu" and _names_cpu(a, k):
                return None  # .to("cpu") of a host tensor: stays on the host
            if k.get("non_blocking") or True in a[1:]:
                return _pageable(t, "Tensor.to")
            return "copy", "Tensor.to"

        def host(t, *a, **k):
            to = target(a, k)
            return _is_host(t) and (to is None or (isinstance(to, torch.Tensor) and _is_host(to)) or _names_cpu(a, k))

        def moved(original: Callable) -> Callable:
            def move(t, *a, **k):
                out = original(t, *a, **k)
                # Here the device is the CPU, so a host tensor "moved" onto it comes back as itself;
                # on a GPU it would be a device tensor: a view stands for it (unmarked, same data).
                return out.view_as(out) if out is t and _is_host(t) and not host(t, *a, **k) else out
            return move
        return lambda original: self._counted(moved(original), classify, host)

    def _copier(self) -> Callable[[Callable], Callable]:
        def classify(dst, src, non_blocking=False):
            if not _is_host(src) or _is_host(dst):
                return None
            return _pageable(src, "Tensor.copy_") if non_blocking else ("copy", "Tensor.copy_")
        return lambda original: self._counted(original, classify)


def _pageable(host: torch.Tensor, what: str) -> tuple[str, str] | None:
    """A non-blocking copy of ``host`` to the device: a possible wait when ``host`` is pageable
    and the copy is not :mod:`tinsmith.transfers`' (which stages it in page-locked memory on a GPU)."""
    if host.is_pinned() or _called_from(_TRANSFERS):
        return None
    return "copy", f"{what} (pageable, non_blocking)"


_TRANSFERS = "/tinsmith/transfers.py"


def _called_from(path_suffix: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(path_suffix):
            return True
        frame = frame.f_back
    return False


def _in_torch_optim() -> bool:
    """Whether torch.optim's own code makes the read (not an optimizer of ours that it calls)."""
    frames = [f for f in traceback.extract_stack(limit=12) if not f.filename.endswith("host_syncs.py")]
    return bool(frames) and "/torch/optim/" in frames[-1].filename


def _names_cpu(a: tuple, k: dict) -> bool:
    """Whether a ``.to`` call names the CPU itself (rather than a device that is the CPU here)."""
    for x in (*a, k.get("device")):
        if isinstance(x, str):
            return x == "cpu" or x.startswith("cpu:")
    return False
