"""bench/gpu/parallel end to end on the CPU (gloo ranks, toy shapes): every row runs and reports figures."""

from __future__ import annotations

import json

import pytest

from bench.gpu.parallel import active_matmul_params, config_dir, main
from tinsmith.models.loading import read_config


@pytest.mark.slow
def test_parallel_bench_runs_on_cpu(tmp_path):
    summary = main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--shapes", "tiny,tiny-moe", "--sizes", "1,2"])
    assert json.loads((tmp_path / "parallel.json").read_text())["sizes"] == [1, 2]
    assert "tiny-moe" in (tmp_path / "parallel.md").read_text()
    for shape in ("tiny", "tiny-moe"):
        rows = summary["shapes"][shape]
        for label in ("plain", "tp1", "tp2", "dp2"):
            assert "error" not in rows[label], rows[label]
            assert rows[label]["train_tokens_per_s"] > 0 and rows[label]["sample_tokens_per_s"] > 0
        assert rows["tp1_vs_plain"]["train"] > 0


def test_active_parameters_count_the_routed_experts_only(tmp_path):
    dense = read_config(config_dir("8B", tmp_path))
    assert 7.5e9 < active_matmul_params(dense) < 8.5e9  # Qwen3-8B: 8.2B with its untied unembedding
    moe = read_config(config_dir("30B-A3B", tmp_path))
    assert 2.8e9 < active_matmul_params(moe) < 3.6e9  # "A3B": about 3.3B active of 30.5B
