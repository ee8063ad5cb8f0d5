"""Programmatic dependent launch: a Triton kernel is scheduled while the kernel before it ends.

A 64-row decode step replayed from a CUDA graph runs about 340 kernels, 570 with 8 adapters; on an
H200 the device idled 0.20 ms (0.71 ms with the adapters) of its 2.27 ms (3.45 ms) step in gaps of
at most 10 us between them: each kernel waits for the one before it to end, then is launched, its
programs scheduled, its prologue run. On Hopper and newer GPUs a kernel launched with the
programmatic-stream-serialization attribute (Triton: ``launch_pdl=True``) may be scheduled once
every program of the kernel before it has signalled (``gdc_launch_dependents``) or ended; it then
waits (``gdc_wait``) until that kernel has completed and its writes are visible. Every kernel
here does that wait before it touches memory, and signals right after it, so the order of every
read and write is the stream's, as without: what overlaps is the next kernel's launch and
scheduling with this one's last programs. (A kernel launched without the attribute, e.g. a GEMM of
torch's, waits for the kernel before it to complete, as always; a kernel that waited completes
only after the one it waited for, so the order holds across any chain of them.)

The decode step's kernels do (decode attention, the norms, the K/V store, SiLU-and-multiply, the
token choice, the adapters' shrink and expand, Gated DeltaNet's step); training's do not: a
training step is bound by the host's launches, not by the gaps between kernels.

Use: a kernel takes ``PDL: tl.constexpr = False`` and calls :func:`wait` with it first thing; its
launch passes ``**options(tensor)`` (``PDL=True, launch_pdl=True`` where :func:`active`, else
nothing). :data:`ENABLED` ``"off"`` launches every kernel as before (benchmarks compare the two).

Before the first use on a device, :func:`active` launches a probe: two dependent launches of a
small kernel, eagerly and replayed from a CUDA graph, must leave the values stream order gives.
Where they do not, or where the driver refuses such launches inside a graph capture (the decode
step would then decode eagerly, several times slower), it stays off on that device, with a
warning saying why. A kernel that fails to build or launch with it turns it off on the device
and is tried again without (:func:`give_up`, which :class:`tinsmith.kernels.guard.KernelGuard`
calls) before its family falls back to torch.
"""

from __future__ import annotations

import functools
import logging

import torch

try:  # optional: ``pip install 'tinsmith[gpu]'``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

log = logging.getLogger(__name__)

# "auto": dependent launches on CUDA devices of compute capability 9.0 or newer whose probe passed;
# "off": every kernel launched as before.
ENABLED = "auto"
_probed: dict[int, str | None] = {}  # device index -> why dependent launches are off there (None: on)


@functools.cache
def supported() -> bool:
    """Whether this Triton can wait on a kernel before and launch with the attribute."""
    if triton is None:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def active(t: torch.Tensor) -> bool:
    """Whether kernels launched for tensors on ``t``'s device use dependent launches (probing the
    device first, unless a graph capture is under way there: then not yet)."""
    if ENABLED == "off" or t.device.type != "cuda" or not supported():
        return False
    index = _index(t.device)
    if index not in _probed:
        if torch.cuda.is_current_stream_capturing():
            return False  # a probe cannot run inside a capture; the next launch outside one probes
        _probed[index] = why = _probe(torch.device("cuda", index))
        if why is not None:  # an older GPU is as expected; a failed probe on a newer one is news
            log.log(logging.INFO if why.startswith("compute capability") else logging.WARNING,
                    "kernels on cuda:%d launch one after another (no programmatic dependent launch): %s", index, why)
    return _probed[index] is None


def options(t: torch.Tensor) -> dict:
    """A launch's keyword arguments for tensors like ``t``: ``PDL`` and ``launch_pdl`` where
    :func:`active`, none otherwise (the kernel's ``PDL`` default is off)."""
    return {"PDL": True, "launch_pdl": True} if active(t) else {}


def give_up(t: torch.Tensor, exc: BaseException) -> bool:
    """After a kernel failed to build or launch for tensors like ``t``: True when dependent launches
    were on for their device (now off there, with a warning, so that the caller can try the kernel
    again launched as before), False when they were not (the failure is the kernel's own)."""
    if not active(t):
        return False
    index = _index(t.device)
    _probed[index] = f"a kernel failed with them ({type(exc).__name__}: {str(exc)[:200]})"
    log.warning("kernels on cuda:%d launch one after another from now on: %s", index, _probed[index])
    return True


def off_reason(device: torch.device) -> str | None:
    """Why dependent launches are off on ``device`` after its probe (None: on, or not probed yet)."""
    return _probed.get(_index(device))


def _index(device: torch.device) -> int:
    """The device's index (a CUDA device named without one: the current device)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


if triton is not None:

    @triton.jit
    def wait(PDL: tl.constexpr):
        """First thing in a kernel: with ``PDL``, wait until the kernel before has completed (its
        writes visible), then let the kernel after be scheduled; nothing without."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _probe_kernel(x_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """``x = x * 2 + ADD`` over ``n`` values: two launches in a row give ``(x * 2 + a) * 2 + b``
        only if the second saw every write of the first."""
        wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2 + ADD, mask=mask)


PROBE_ADDS = (1, 3)  # the probe's launches in a row: x = x * 2 + add


def probe_value(rounds: int) -> float:
    """What every value of the probe's tensor (ones at first) holds after ``rounds`` rounds of its
    launches, each seeing all the writes of the one before."""
    value = 1.0
    for _ in range(rounds):
        for add in PROBE_ADDS:
            value = value * 2 + add
    return value


def _probe(device: torch.device) -> str | None:
    """Why dependent launches cannot serve on ``device`` (None: they can): needs compute
    capability 9.0, then two dependent launches, eager and from a CUDA graph, must give stream order's values."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))} (9.0 is needed)"
    n, block = 1 << 16, 1024
    try:
        x = torch.ones(n, dtype=torch.float32, device=device)

        def launches() -> None:
            for add in PROBE_ADDS:
                _probe_kernel[(n // block,)](x, n, ADD=add, BLOCK=block, PDL=True, launch_pdl=True)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            launches()  # compiles them, outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            launches()  # recorded, not run
        graph.replay()
        torch.cuda.synchronize(device)
        if not bool((x == probe_value(rounds=2)).all()):  # the eager round, then the replayed one
            return "the probe's dependent launches left other values than stream order gives"
        return None
    except Exception as exc:  # an old driver, or a graph capture that refuses the attribute
        return f"{type(exc).__name__}: {str(exc)[:200]}"
