"""bench/gpu end to end on the CPU (tiny shape, quick sizes): every part runs and reports figures."""

from __future__ import annotations

import json

import pytest

from bench.gpu.run import main


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench"
    summary = main(["--out", str(out), "--device", "cpu", "--quick", "--shapes", "tiny",
                    "--cache-dir", str(tmp_path / "cache"), "--budget-scale", "100"])
    assert {p.name for p in out.iterdir()} == {"peak.json", "train.json", "sample.json", "moe.json", "summary.json", "summary.md"}
    assert json.loads((out / "summary.json").read_text())["shapes"] == ["tiny"]
    for part in ("train", "sample", "moe"):
        for key, result in summary[part].items():
            assert "error" not in result and "skipped" not in result, (key, result)
    assert summary["train"]["tiny/lora"]["tenants"]["4"]["tokens_per_s"] > 0
    assert summary["train"]["tiny/lora"]["tenants"]["4"]["grouped_ops_vs_one_tenant"] > 0
    four = summary["train"]["tiny/lora"]["tenants"]["4"]  # side by side with one tenant, pair by pair
    assert four["vs_one_tenant_paired"] > 0 and len(four["paired_ratios"]) == 2
    assert min(four["paired_ratios"]) <= four["vs_one_tenant_paired"] <= max(four["paired_ratios"])
    assert len(summary["train"]["tiny/lora"]["tenants"]["4"]["steps_s"]) == 2  # every timed step, quick: 2
    phases = summary["train"]["tiny/lora"]["tenants"]["4"]["phases"]
    assert phases["forward_backward_ms"] > 0 and phases["optimizer_steps_ms"] > 0
    assert "synced phases" in (out / "summary.md").read_text()
    four_by_rows = summary["train"]["tiny/lora"]["tenants"]["4x1"]  # the shape, quick: a row each
    assert four_by_rows["vs_one_tenant"] > 0 and four_by_rows["phases"]["optimizer_steps_ms"] > 0
    assert four_by_rows["vs_one_tenant_paired"] > 0
    assert "side by side" in (out / "summary.md").read_text()
    decode = summary["sample"]["tiny/decode"]["rows_4"]  # the roofline counts FLOPs too: never above the bytes' bound
    assert 0 < decode["roofline_tokens_per_s"] <= decode["hbm_bound_tokens_per_s"] * (1 + 1e-9)
    assert decode["of_roofline_with_prefill"] >= decode["of_bound_with_prefill"] * (1 - 1e-9)
    assert "4 tenants x 8 rows vs 1" in (out / "summary.md").read_text()
    assert summary["train"]["tiny/lora"]["packing"]["packed_vs_padded"] > 0
    sft = summary["train"]["tiny/sft_curves"]  # fp32 on a CPU: the runtime's curves are the plain path's
    assert sft["dtype"] == "float32" and len(sft["curves"]["tinsmith"]) == sft["steps"]
    assert sft["max_rel_dev"]["tinsmith"] < 1e-5 and sft["within_bf16_noise"]
    assert "SFT loss curves" in (out / "summary.md").read_text()
    long = summary["train"]["tiny/lora"]["long_context"]["auto"]  # attention's matmuls on top of 4NT
    assert long["mfu_with_attention"] > long["mfu_4nt"] > 0
    assert "MFU 4NT / with attention" in (out / "summary.md").read_text()
    on_80gb = summary["train"]["tiny/lora"]["long_context"]["auto_80gb"]  # a CPU: nothing to cap
    assert on_80gb["tokens_per_s"] > 0 and "memory_cap_gib" not in on_80gb
    assert "within an 80 GB card's memory (the card itself" in (out / "summary.md").read_text()
    assert summary["train"]["tiny/lora"]["torch_elementwise"]["kernels_vs_torch"] > 0  # the CPU's torch both ways
    assert summary["train"]["tiny/lora"]["lora_as_ops"]["nodes_vs_ops"] > 0
    assert summary["train"]["tiny/lora"]["loss_softmax_in_torch"]["kernels_vs_torch"] > 0
    assert summary["sample"]["token_choice"]["rows_4"]["torch"]["us"] > 0
    assert "one program a row" in (out / "summary.md").read_text()
    assert "expand by output block" in (out / "summary.md").read_text()
    assert summary["train"]["attention_backends"]["1x256"]["math"]["ms"] > 0  # a CPU has the math backend only
    copies = summary["train"]["copies_behind_work"]  # a CPU queues nothing: the copies' own cost
    assert copies["to_device"]["host_ms_median"] > 0 and copies["pageable_non_blocking"]["busy_ms_median"] == 0
    assert "copy to the device behind" in (out / "summary.md").read_text()
    assert "causal attention alone" in (out / "summary.md").read_text()
    assert summary["train"]["tiny/lora"]["cudnn_attention"]["vs_default"] > 0  # the CPU's math backend both ways
    assert summary["train"]["tiny/lora"]["long_context"]["cudnn_vs_auto"] > 0
    assert "packed vs padded" in (out / "summary.md").read_text()
    assert "Against the issues' targets" in (out / "summary.md").read_text()
    assert len(summary["targets"]) > 10 and all(t["met"] is None for t in summary["targets"])  # no real shape ran
    rows_4 = summary["sample"]["tiny/decode"]["rows_4"]
    assert 0 < rows_4["of_hbm_bound"] and rows_4["bound_with_prefill_tokens_per_s"] < rows_4["hbm_bound_tokens_per_s"]
    replayed = summary["sample"]["tiny/replay_profile"]["rows_4"]  # on a CPU the static step runs eagerly
    assert replayed["unprofiled_ms_per_step"] > 0 and replayed["burst_alone_ms_per_step"] > 0
    assert summary["moe"]["a3b_vs_dense"]["train_moe_vs_dense"] > 0
    waves = summary["sample"]["tiny/prefix_waves"]
    for layout in ("rows", "paged"):  # the second wave's 2 prompts of 130 tokens were kept whole: nothing to compute
        assert waves[f"{layout}/cache_on"]["second_wave_prompt_tokens_computed"] == 0
        assert waves[f"{layout}/cache_off"]["second_wave_prompt_tokens_computed"] == 2 * 4 * 130
    assert "second wave tok/s" in (out / "summary.md").read_text()
    # The profiled steps: each case's time by family adds up to its total, the top kernels within it.
    for part, key, cases in (("train", "tiny/profile", ("one_tenant", "four_tenants")),
                             ("sample", "tiny/decode_profile", ("base", "adapters_8"))):
        for case in cases:
            t = summary[part][key][case]
            assert t["source"] == "cpu aten ops" and t["kernels"] > 0 and t["steps"] >= 1
            assert sum(t["families_ms"].values()) == pytest.approx(t["device_ms"], rel=1e-2)
            assert 0 < t["top"][0][1] <= t["device_ms"]
    for case in ("rows_4", "rows_4_adapters_8"):  # replayed steps (eager on a CPU): kernels, then the host's share
        t = summary["sample"]["tiny/replay_profile"][case]
        assert t["steps"] >= 1 and t["host_top"] and all(ms >= 0 for _, ms, _ in t["host_top"])
    bursts = summary["sample"]["tiny/decode_bursts"]["rows_4"]
    assert bursts["burst_4"] > 0 and bursts["burst_16_vs_4"] > 0 and bursts["ahead_vs_read_first"] > 0
    assert bursts["scattered_ahead_vs_read_first"] > 0
    assert "per host read-back" in (out / "summary.md").read_text()
    dependent = summary["sample"]["tiny/dependent_launches"]  # off on a CPU: the same launches both ways
    assert not dependent["active"] and dependent["base"]["on_vs_off"] > 0 and dependent["adapters_8"]["on_vs_off"] > 0
    assert "launched dependent on the kernel before" in (out / "summary.md").read_text()
    expands = summary["sample"]["tiny/expands_in_kernels"]  # the same torch ops both ways on a CPU
    assert all(expands[k][f"{mode}_vs_off"] > 0 for k in ("adapters_8", "adapters_64")
               for mode in ("on", "without_norms", "without_silu_shrink"))
    assert "taken by the kernels reading their outputs" in (out / "summary.md").read_text()
    assert summary["sample"]["tiny/decode"]["rows_4"]["captures_in_timed_run"] == 0  # no graphs on a CPU
    decode = summary["sample"]["tiny/decode"]  # adapters at each row count, beside the bytes' bound
    for key, rows in (("adapters_8", 4), ("adapters_64", 4), ("adapters_8_rows_8", 8), ("adapters_64_rows_8", 8)):
        assert decode[key]["rows"] == rows and decode[key]["vs_base"] > 0
        assert 0 < decode[key]["bytes_bound_vs_base"] < 1 and decode[key]["of_bytes_bound"] > 0
    assert "64 adapters vs base (by tiles; bytes bound)" in (out / "summary.md").read_text()
    four, one = summary["train"]["tiny/profile"]["four_tenants"], summary["train"]["tiny/profile"]["one_tenant"]
    assert four["kernels"] > one["kernels"]  # four adapters' own LoRA work
    assert "Where a step's time goes" in (out / "summary.md").read_text()
    grpo = summary["sample"]["tiny/sdk"]["grpo"]
    assert grpo["separate_server"]["requests"] == 2 * 4 and grpo["num_samples_server"]["requests"] == 2
    assert grpo["separate_server"]["asample_http_mean_s"] > 0
    assert grpo["separate_server"]["prefills"] >= 2 and grpo["separate_server"]["decode_steps"] > 0
    timeline = grpo["separate_timeline"]  # read from the server's store: every request of the timed round
    assert timeline["requests"] == 2 * 4
    assert 0 <= timeline["first_arrival_s"] <= timeline["last_arrival_s"] <= timeline["last_completion_s"]
    assert 0 <= timeline["first_send_s"] <= timeline["last_send_s"] <= timeline["last_arrival_s"]  # the SDK's sends
    assert grpo["separate_after_last_arrival_vs_num_samples"] >= grpo["separate_vs_num_samples"]  # less the window
    pyqwest = summary["sample"]["tiny/sdk_pyqwest"]["grpo"]  # the same traffic, the SDK on pyqwest
    assert pyqwest["separate_server"]["requests"] == 2 * 4 and pyqwest["separate_cpu"]["client_ms_per_request"] > 0
    assert "tiny (pyqwest) | separate" in (out / "summary.md").read_text()
    fair = summary["sample"]["tiny/fair_share"]  # the light request got a row back long before the busy rows ended
    assert fair["yielded_rows"] == 1 and fair["light_waited_steps"] < fair["new_tokens"] and fair["busy_kept"] > 0
    beside = summary["sample"]["tiny/beside_training"]
    assert beside["train_kept"] > 0 and beside["sample_kept"] > 0
    assert beside["alone"]["train_ahead_tokens_per_s"] > 0  # the same loop, a step sent ahead
    steps = beside["train_alone_steps"]  # the training alone through the SDK, step by step as the server saw it
    assert steps["steps"] == 2 and steps["micro_batch_tokens"] == 2048  # the CPU's planned micro-batch
    assert 0 < steps["forward_backward_run_ms"] < steps["server_span_ms"] < steps["step_ms"]
    assert steps["rest_ms"] == pytest.approx(steps["step_ms"] - steps["server_span_ms"])
    assert steps["forward_backward_http_ms"] > 0 and steps["client_cpu_ms_per_step"] >= 0
    skinny = summary["sample"]["tiny/decode_skinny"]  # torch's products both ways on a CPU
    assert skinny["rows_4"]["adapters_8"]["on_vs_off"] > 0 and skinny["rows_8"]["base"]["on_vs_off"] > 0
    assert skinny["kernel_failed"] is None and skinny["adapters_8_shrink_apart"]["shrink_in_product_vs_apart"] > 0
    products = summary["sample"]["skinny_products"]  # the kernel in the interpreter where tests set it
    for name in ("qkv", "o", "down"):
        row = products[name]["rows_4"]
        assert row["cublas_us"] > 0 and row["cublas_of_copy_rate"] > 0
        if products["kernels_usable"]:
            assert row["kernel_us"] > 0 and row["max_rel_diff"] < 1e-5 and row["plan"]["splits"] >= 1
    assert "products with the weights" in (out / "summary.md").read_text()
    assert "skinny-product kernel vs cuBLAS" in (out / "summary.md").read_text()



def test_headline_runs_the_targets_figures_alone(tmp_path):
    """``--headline``: per shape one tenant's 8 x 1024 (quick: 1 x 32) and decode without adapters,
    under the keys the targets read; nothing else."""
    out = tmp_path / "bench"
    summary = main(["--out", str(out), "--device", "cpu", "--quick", "--shapes", "tiny", "--headline",
                    "--parts", "train,sample", "--cache-dir", str(tmp_path / "cache"), "--budget-scale", "100"])
    assert list(summary["train"]) == ["tiny/lora"] and list(summary["sample"]) == ["tiny/decode"]
    lora = summary["train"]["tiny/lora"]
    assert lora["1x32"]["mfu_4nt"] > 0 and lora["1x32"]["mfu_with_attention"] > lora["1x32"]["mfu_4nt"]
    decode = summary["sample"]["tiny/decode"]
    assert decode["rows_4"]["tokens_per_s"] > 0 and decode["rows_8"]["tokens_per_s"] > 0
    assert not any(k.startswith("adapters_") for k in decode)
    assert "Against the issues' targets" in (out / "summary.md").read_text()
