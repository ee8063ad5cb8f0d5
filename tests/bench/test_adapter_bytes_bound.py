"""bench/gpu's bytes bound of a decode step with adapters: the arithmetic docs/performance.md
states for the 1.7B shape ("What the adapter targets ask")."""

from __future__ import annotations

import pytest

from bench.gpu.sample import adapter_bytes_bound_vs_base
from bench.gpu.shapes import qwen3_config


def test_the_bound_is_the_documented_share_of_the_base_models_speed():
    config = qwen3_config("1.7B")
    bound = lambda rows, adapters: adapter_bytes_bound_vs_base(config, rows, 128, 256, adapters, 32, 2)  # noqa: E731
    assert bound(64, 8) == pytest.approx(0.893, abs=1e-3)
    assert bound(64, 64) == pytest.approx(0.511, abs=1e-3)
    assert bound(256, 64) == pytest.approx(0.683, abs=1e-3)
    # Rows read the adapters they take: eight rows of 64 adapters read eight, as eight adapters do.
    assert bound(8, 64) == bound(8, 8) > bound(64, 64)
