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


def test_the_roofline_counts_the_products_flops_where_many_rows_outgrow_the_weights_bytes():
    """At the H200's measured peaks (765 TFLOP/s, 4,166 GB/s), a 64-row step of the 1.7B shape is
    bound by bytes alone (the HBM bound's 50,118 tok/s), while at 256 rows its products take their
    FLOPs' 1.15 ms rather than their bytes' 0.83 ms: 86.8k tok/s against the HBM bound's 97,334;
    the 8B shape's 256 rows 34.6k against 43,004."""
    from bench.gpu.sample import roofline_step_s, step_bytes

    for shape, rows, hbm, roofline in (("1.7B", 64, 50_118, 50_118), ("1.7B", 256, 97_334, 86_800),
                                       ("8B", 256, 43_004, 34_600)):
        config = qwen3_config(shape)
        assert rows / (step_bytes(config, rows, 128, 256, 2) / 4.166e12) == pytest.approx(hbm, rel=2e-3)
        assert rows / roofline_step_s(config, rows, 128, 256, 2, 4.166e12, 765e12) == pytest.approx(roofline, rel=5e-3)
