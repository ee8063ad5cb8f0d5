"""bench/gpu's multi-adapter LoRA item on the CPU (quick sizes): the shrink before and after
split-K runs (in Triton's interpreter where tests set it), agree, and reach summary.md."""

from __future__ import annotations

import torch

from bench.gpu import sample
from bench.gpu.report import markdown
from tinsmith.kernels import lora_gather


def test_lora_gather_item_runs_and_is_reported():
    result = sample.lora_gather(torch.device("cpu"), {"copy_bytes_per_s": 1e10}, quick=True)
    case = result["rows_4_adapters_2"]
    assert set(case) == {"qkv", "o", "gate_up", "down", "layer"}
    assert all(case[p]["torch_pair_us"] > 0 for p in ("qkv", "o", "gate_up", "down"))
    if result["kernels_usable"]:  # TRITON_INTERPRET=1 (tests/conftest.py)
        for p in ("qkv", "o", "gate_up", "down"):
            r = case[p]
            assert r["split"] >= 1 and r["shrink_new_us"] > 0 and r["expand_us"] > 0 and r["pair_new_vs_old"] > 0
            assert r["max_rel_diff"] < 1e-4 and r["bitwise_repeatable"] is True
            assert r["segmented_pair_us"] > 0 and r["segmented_max_rel_diff"] < 1e-4  # by tiles: the same sums
        assert case["layer"]["new_vs_old"] > 0 and case["layer"]["segmented_vs_new"] > 0
        assert set(result["split_sweep"]["shrink_us"]) == {"qkv", "o", "gate_up", "down"}
    else:
        assert not lora_gather.triton_interpreting()
    summary = {"peak": {"device_name": "cpu", "matmul_flops_per_s": 1e12, "copy_bytes_per_s": 1e10},
               "torch": torch.__version__, "quick": True, "shapes": ["tiny"], "sample": {"lora_gather": result}}
    md = markdown(summary)
    assert "Multi-adapter LoRA kernels" in md and "| 4 | 2 | qkv |" in md and "**layer**" in md
    failed = markdown({**summary, "sample": {"lora_gather": {"error": "RuntimeError: boom"}}})
    assert "error: RuntimeError: boom" in failed
