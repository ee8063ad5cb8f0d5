"""Readings of the machine the server runs on: host memory, and per accelerator its memory and load.

One place for them, so that ``/metrics``, the dashboard and ``tinsmith status`` show the same
numbers. Every reading is cheap (no device synchronisation) and never raises: a value that cannot
be read on this machine is ``None``, never a made-up zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import psutil
import torch

from tinsmith import device_memory


@dataclass
class DeviceReading:
    """One accelerator. ``used_bytes`` counts every process on the device (driver view);
    ``allocated_bytes``/``reserved_bytes`` are this process's tensors and its caching allocator,
    ``limit_bytes`` what that allocator may reserve (``--device-memory-fraction``; None: no cap).
    ``allocator_retries``: how often that allocator found no cached block that fits, gave its
    cached blocks back to the driver and tried again; ``device_frees``: its ``cudaFree`` calls in
    all. Each ``cudaFree`` waits for every kernel queued on the device, so a count that grows
    while the server works (fragmented memory near its limit) is the device idling for the host."""

    index: int
    name: str
    total_bytes: int | None = None
    used_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    limit_bytes: int | None = None
    utilization_percent: float | None = None
    allocator_retries: int | None = None
    device_frees: int | None = None


@dataclass
class HealthReading:
    process_rss_bytes: int
    host_total_bytes: int
    host_available_bytes: int
    cpu_percent: float
    devices: list[DeviceReading] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


_process = psutil.Process()


def _device_reading(index: int) -> DeviceReading:
    reading = DeviceReading(index=index, name=torch.cuda.get_device_name(index))
    try:
        reading.total_bytes = int(torch.cuda.get_device_properties(index).total_memory)
        if torch.cuda.memory_reserved(index) > 0:  # a device this process computes on
            free, total = torch.cuda.mem_get_info(index)
            reading.used_bytes = int(total - free)
        else:  # asked without a CUDA context of this process there (mem_get_info would make one,
            # ~0.5 GB on each GPU that other ranks use): from NVML, when installed
            reading.used_bytes = int(torch.cuda.device_memory_used(index))
    except Exception:  # noqa: BLE001 - no NVML (ModuleNotFoundError), or a driver that refuses
        pass
    stats = torch.cuda.memory_stats(index)
    reading.allocated_bytes = int(stats.get("allocated_bytes.all.current", 0))
    reading.reserved_bytes = int(stats.get("reserved_bytes.all.current", 0))
    reading.allocator_retries = stats.get("num_alloc_retries")
    reading.device_frees = stats.get("num_device_free")
    reading.limit_bytes = device_memory.cap(torch.device("cuda", index))
    try:  # needs NVML (the nvidia-ml-py package); absent on many installs
        reading.utilization_percent = float(torch.cuda.utilization(index))
    except Exception:  # noqa: BLE001 - ModuleNotFoundError, or an NVML error on this driver
        reading.utilization_percent = None
    return reading


def read_health() -> HealthReading:
    """Host memory and CPU of this process's machine, and every CUDA device this process sees."""
    memory = psutil.virtual_memory()
    devices = ([_device_reading(i) for i in range(torch.cuda.device_count())]
               if torch.cuda.is_available() else [])
    return HealthReading(process_rss_bytes=_process.memory_info().rss, host_total_bytes=memory.total,
                         host_available_bytes=memory.available, cpu_percent=psutil.cpu_percent(interval=None),
                         devices=devices)
