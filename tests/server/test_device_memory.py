"""The device memory a server may use: ``--device-memory-fraction``'s arithmetic and its reach.

On a CPU there is nothing to cap; what a cap does to the planners on a GPU is checked by
tests/gpu/test_device_memory_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tinsmith import device_memory
from tinsmith.parallel.serving import RANK_DEVICE_SWITCHES, configured_rank, runtime_kwargs_of
from tinsmith.server.config import ServerConfig
from tinsmith.server.health import DeviceReading
from tinsmith.server.state import ServerState
from tinsmith.status import render

GIB = 1 << 30


@pytest.mark.parametrize("free, total, cap, reserved, expected", [
    (70 * GIB, 141 * GIB, 80 * GIB, 10 * GIB, (70 * GIB, 80 * GIB)),  # the cap leaves more than the device: the device's
    (120 * GIB, 141 * GIB, 80 * GIB, 10 * GIB, (70 * GIB, 80 * GIB)),  # the device leaves more than the cap: the cap's
    (120 * GIB, 141 * GIB, 80 * GIB, 90 * GIB, (0, 80 * GIB)),  # already over the cap (reserved before it was set)
    (30 * GIB, 40 * GIB, 80 * GIB, 0, (30 * GIB, 40 * GIB)),  # a cap above the device's size
])
def test_free_memory_within_a_cap_is_what_the_allocator_may_still_take(free, total, cap, reserved, expected):
    assert device_memory.within_cap(free, total, cap, reserved) == expected


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01])
def test_a_fraction_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        device_memory.limit(torch.device("cpu"), fraction)


def test_a_cpu_device_has_no_cap_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="tinsmith.device_memory"):
        device_memory.limit(torch.device("cpu"), 0.5)
    assert device_memory.cap(torch.device("cpu")) is None
    assert "--device-memory-fraction 0.5 has no effect on cpu" in caplog.text
    caplog.clear()
    device_memory.limit(torch.device("cpu"), 1.0)  # the default: nothing to say
    assert not caplog.text


def test_the_option_reaches_the_worker_and_every_rank_process(tmp_path):
    config = ServerConfig(base_model=["m"], data_dir=str(tmp_path), device_memory_fraction=0.6)
    state = ServerState.build(config)  # loads no model: the worker only keeps its options here
    try:
        options = state.worker.options
    finally:
        state.store.close()
    assert options.device_memory_fraction == 0.6
    kwargs = runtime_kwargs_of(options)  # what a tensor- or data-parallel rank process is started with
    assert kwargs["device_memory_fraction"] == 0.6 and set(RANK_DEVICE_SWITCHES) <= set(kwargs)
    # the rank applies the switches to its process and builds its runtime from the rest
    rest = configured_rank(torch.device("cpu"), kwargs)
    assert not set(RANK_DEVICE_SWITCHES) & set(rest) and rest["max_lora_rank"] == options.max_lora_rank


def test_status_says_what_the_server_may_reserve():
    reading = DeviceReading(index=0, name="GPU", total_bytes=141 * GIB, used_bytes=GIB, allocated_bytes=GIB,
                            reserved_bytes=GIB, limit_bytes=80 * GIB)
    summary = _summary([reading.__dict__])
    assert "this server may reserve 80" in render(summary)
    assert "gave memory back" not in render(summary)  # no retries read (or none made): nothing said
    reading.limit_bytes = None
    reading.allocator_retries = 3
    text = render(_summary([reading.__dict__]))
    assert "may reserve" not in text and "gave memory back to fit 3 allocations" in text


def _summary(devices: list[dict]) -> dict:
    return {"caller": {"owner": "k", "admin": False, "single_user": True},
            "server": {"version": "0", "uptime_s": 1.0, "base_models": ["m"]},
            "health": {"process_rss_bytes": GIB, "host_available_bytes": GIB, "host_total_bytes": 2 * GIB,
                       "cpu_percent": 1.0, "devices": devices},
            "throughput": {"window_s": 60, "tokens_trained": 0, "train_tokens_per_s": 0.0, "tokens_sampled": 0,
                           "sample_tokens_per_s": 0.0},
            "runs": [], "queue": [], "samplers": []}
