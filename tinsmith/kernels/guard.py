"""Falling back from a kernel that cannot run on this machine, once and loudly.

A Triton kernel that fails to build or launch on a GPU (an older Triton, an unexpected shape, a
compiler bug) must not fail the requests that reached it: the first failure is logged with its
cause, the kernel family is switched off, and the torch path serves from then on (first, where the
kernel was launched dependent on the kernel before, that is switched off and the kernel tried once
more: :mod:`tinsmith.kernels.pdl`). CUDA faults
(an illegal access) are not caught: they poison the context, and the engine must see them. In
Triton's interpreter (tests) every failure is raised.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (on CPU tensors), as tests have it."""
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


class KernelGuard:
    def __init__(self, what: str, instead: str):
        self.what, self.instead = what, instead
        self.failed: str | None = None  # why the kernels were switched off

    def allows(self, backend: str, on: torch.Tensor) -> bool:
        """Whether a kernel family whose switch is ``backend`` ("auto": CUDA tensors, "triton": any
        tensor, CPU ones in the interpreter, "torch": none) may run on ``on``'s device: the family
        has not failed here. (Triton's presence is the caller's to check.)"""
        if backend == "torch" or self.failed is not None:
            return False
        return backend == "triton" or on.is_cuda

    def call(self, fn: Callable[..., T], *args, on: torch.Tensor, **kwargs) -> T | None:
        """``fn(*args, **kwargs)``, or None once the kernels are off (``on``: a tensor of the call,
        to tell a graph capture in progress, where nothing may be swallowed)."""
        if self.failed is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if (triton_interpreting() or type(exc).__name__ == "AcceleratorError"
                    or (on.is_cuda and torch.cuda.is_current_stream_capturing())):
                raise
            from tinsmith.kernels import pdl  # late: pdl imports Triton

            if pdl.give_up(on, exc):  # launched dependent on the kernel before: once more without
                try:
                    return fn(*args, **kwargs)
                except Exception as again:
                    exc = again
            self.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.warning("the %s cannot run here (%s); %s from now on", self.what, self.failed, self.instead)
            return None

    def ran(self, fn: Callable[..., object], *args, on: torch.Tensor) -> bool:
        """Whether ``fn(*args)`` (a kernel writing its output in place) ran here: :meth:`call` for
        kernels that return nothing."""
        return self.call(_run, fn, *args, on=on) is not None


def _run(fn: Callable[..., object], *args) -> bool:
    fn(*args)
    return True
