"""How much device memory this process may use, and how much of that is free.

Three things size themselves from the device's free memory when the server starts: training
micro-batches (half of it, :func:`tinsmith.worker.service.auto_micro_batch_tokens`), each
sampler's K/V budget (40%) and the messages that say why a step ran out of memory. On a GPU
shared with another process (a second server, an inference engine beside the trainer), "free"
is whatever the others left at that moment, and nothing stops this process from taking the rest
later. ``--device-memory-fraction`` (vLLM's ``--gpu-memory-utilization``, SGLang's
``--mem-fraction-static``) bounds it: :func:`limit` caps PyTorch's caching allocator at that
share of the device (``torch.cuda.set_per_process_memory_fraction``: an allocation beyond it
raises out-of-memory in this process, as a full device would), and :func:`free_and_total` is the
device's free memory as this process may still use it, which every planner reads instead of
``torch.cuda.mem_get_info``.

What the allocator does not hold (the CUDA context, about half a GB; cuBLAS and NCCL workspaces)
is outside the cap, as it is outside vLLM's. Benchmarks use the cap to run a larger card as a
smaller one (bench/gpu: a 32k-token step within an 80 GB card's memory on an H200).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def limit(device: torch.device, fraction: float) -> None:
    """Let this process's allocator reserve at most ``fraction`` of ``device``'s memory (1.0: all
    of it, as without a cap). Not a CUDA device: nothing to cap."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a device memory fraction is in (0, 1], not {fraction}")
    if device.type != "cuda":
        if fraction < 1.0:
            log.warning("--device-memory-fraction %g has no effect on %s: it caps a GPU's memory", fraction, device)
        return
    index = _index(device)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    if fraction < 1.0:
        log.info("this process may reserve %.1f GiB of cuda:%d's %.1f GiB (--device-memory-fraction %g)",
                 cap(device) / 2**30, index, torch.cuda.get_device_properties(index).total_memory / 2**30, fraction)


def cap(device: torch.device) -> int | None:
    """Bytes this process's allocator may reserve on ``device`` (None: no cap). Read from the
    allocator itself, so a cap set by other code (a test, a benchmark) counts as well."""
    if device.type != "cuda" or not torch.cuda.is_initialized():  # no cap is set before CUDA starts
        return None
    index = _index(device)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(index).total_memory)


def free_and_total(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA ``device`` as this process may use them: the device's free
    memory and size (``torch.cuda.mem_get_info``), within the cap when one is set."""
    free, total = torch.cuda.mem_get_info(device)
    limit_bytes = cap(device)
    if limit_bytes is None:
        return int(free), int(total)
    return within_cap(int(free), int(total), limit_bytes, int(torch.cuda.memory_reserved(device)))


def within_cap(free: int, total: int, limit_bytes: int, reserved: int) -> tuple[int, int]:
    """The device's ``free``/``total`` bytes seen through a cap of ``limit_bytes`` on an allocator
    that holds ``reserved`` now: what the allocator may still take (never more than the device
    has free), and the cap as the total."""
    return max(0, min(free, limit_bytes - reserved)), min(total, limit_bytes)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
