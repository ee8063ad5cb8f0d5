"""The machine's measured ceilings: dense bf16 matmul FLOP/s and device-to-device copy bytes/s.

MFU and the decode bound are stated against these (measured, not datasheet), so a figure
reads the same on any card. Copy bandwidth counts bytes read plus bytes written.
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` ones."""
    times = sorted(each_timed(fn, device, repeats, warmup))
    return times[len(times) // 2]


def each_timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn()`` (device synced around each) after ``warmup`` ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def replayed_us(fn, device: torch.device, quick: bool, calls: int = 20) -> float:
    """Microseconds per call of ``fn``: on a GPU the mean over ``calls`` calls replayed from one CUDA
    graph (median of 5 replays; launched one by one, a call this short times the host's launch,
    not the GPU); elsewhere the median of plain calls."""
    if device.type != "cuda":
        return timed(fn, device, repeats=1 if quick else 20, warmup=1 if quick else 2) * 1e6
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def matmul_flops(device: torch.device, quick: bool) -> float:
    n = 1024 if (quick or device.type == "cpu") else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # random data: zeros run faster
    return 2 * n**3 / timed(lambda: a @ b, device, repeats=5 if quick else 20)


def copy_bytes_per_s(device: torch.device, quick: bool) -> float:
    n = (16 << 20) if (quick or device.type == "cpu") else (1 << 30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), device, repeats=5 if quick else 20)


def measure(device: torch.device, quick: bool) -> dict:
    return {"matmul_flops_per_s": matmul_flops(device, quick), "copy_bytes_per_s": copy_bytes_per_s(device, quick),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__}
