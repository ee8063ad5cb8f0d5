"""Telling a failed device from a failed request.

Most errors belong to one request (bad input, a loss that refused) and the server carries on.
A few mean the accelerator itself is gone or its context is poisoned: an illegal memory access,
a device-side assertion, an ECC error, a GPU that fell off the bus, or a tensor-parallel rank
that died (a failed collective leaves the ranks out of step). CUDA makes such errors
sticky, so every later kernel fails too. The engine must then stop running work and say so
plainly (a failed request says what happened and that the server needs a restart; /healthz
turns unhealthy) instead of failing each request with an opaque CUDA message, or hanging.

Classified by the exception's type name and text, so the engine needs no torch import.
"""

from __future__ import annotations

# Error texts of CUDA, its libraries and NCCL that no retry can cure. Out of memory is not one
# of them: it belongs to the request that asked for too much.
_FATAL_MARKERS = (
    "cuda error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "uncorrectable ecc",
    "fallen off the bus",
    "no cuda gpus are available",
    "cuda driver error",
    "cublas_status_execution_failed",
    "cublas_status_internal_error",
    "cudnn_status_execution_failed",
    "nccl error",
)
# AcceleratorError: torch >= 2.8 raises it for CUDA runtime errors. ParallelError: a rank of the
# tensor-parallel group died or a collective failed; the ranks are out of step until a restart.
_FATAL_TYPES = ("AcceleratorError", "ParallelError")


def device_fault(exc: BaseException) -> str | None:
    """A one-line description when ``exc`` means the device failed, else None."""
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if type(exc).__name__ in _FATAL_TYPES or any(m in str(exc).lower() for m in _FATAL_MARKERS):
        return f"{type(exc).__name__}: {text}"[:300]
    return None
