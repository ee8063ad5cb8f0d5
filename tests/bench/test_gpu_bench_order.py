"""bench/gpu's running order: the targets' items, then the headline shapes', then the diagnostics.

A device call has a fixed budget and items past it are skipped, so the order decides what a call
that runs long loses. The items' own measurements are replaced here by recorders (each item's
real run is tests/bench/test_gpu_bench_cpu.py's); what runs is the orchestration of
``bench.gpu.run``: which items run, in which order, and which checkpoints get made.
"""

from __future__ import annotations

import pytest

from bench.gpu import curves, products, profile, run, sample, train

RECORDED_TRAIN = {"lora": train, "lora_headline": train, "peft_baseline": train, "full_finetune": train,
                  "launch_costs": train, "copies_behind_work": train, "attention_backends": train,
                  "sft_curves": curves, "train_step": profile}
RECORDED_SAMPLE = {"in_process": sample, "through_sdk": sample, "generate_baseline": sample, "decode_bursts": sample,
                   "dependent_launches": sample, "expands_in_kernels": sample, "beside_training": sample, "fair_share": sample,
                   "decode_attention": sample, "delta_rule_step": sample, "token_choice": sample, "lora_gather": sample,
                   "kv_layouts": sample, "prefix_waves": sample, "chunked_prefill": sample, "graphs_vs_eager": sample,
                   "decode_step": profile, "decode_replayed": profile, "products": products,
                   "decode_with_kernel": products}


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Every item's measurement replaced by a recorder, and checkpoints by directories named after
    their shape: ``(calls, made)``, the measurements called (name, its model directory's shape or
    None) and the shapes whose checkpoints were made, in order."""
    calls: list[tuple[str, str | None]] = []
    made: list[str] = []

    def checkpoint(name, cache_dir, device):
        made.append(name)
        return tmp_path / name

    def recorder(fn_name):
        def record(*args, **kwargs):
            where = next((a.name for a in args if hasattr(a, "name") and a.parent == tmp_path), None)
            calls.append((fn_name, where))
            return {"recorded": fn_name}
        return record

    monkeypatch.setattr(run, "checkpoint", checkpoint)
    for table in (RECORDED_TRAIN, RECORDED_SAMPLE):
        for fn_name, module in table.items():
            monkeypatch.setattr(module, fn_name, recorder(fn_name))
    return calls, made


def _main(tmp_path, *args: str) -> dict:
    return run.main(["--out", str(tmp_path / "bench"), "--device", "cpu", "--quick", "--parts", "train,sample",
                     "--cache-dir", str(tmp_path / "cache"), *args])


def test_headline_shapes_run_after_the_targets_items_and_before_the_diagnostics(recorded, tmp_path):
    calls, made = recorded
    summary = _main(tmp_path, "--shapes", "1.7B", "--headline-shapes", "4B,8B")
    assert list(summary["train"]) == ["1.7B/lora", "1.7B/peft_baseline", "1.7B/sft_curves", "1.7B/full_finetune",
                                      "4B/lora", "8B/lora",
                                      "1.7B/profile", "launch_costs", "copies_behind_work", "attention_backends"]
    sample_keys = list(summary["sample"])
    assert sample_keys[:4] == ["1.7B/decode", "1.7B/sdk", "4B/decode", "8B/decode"]
    assert sample_keys[4:6] == ["1.7B/decode_profile", "1.7B/replay_profile"] and sample_keys[-1] == "1.7B/cuda_graphs"
    # the headline shapes take the targets' figures alone: one tenant's step, decode without adapters
    assert ("lora_headline", "4B") in calls and ("lora_headline", "8B") in calls
    assert ("lora", "4B") not in calls and ("lora", "8B") not in calls
    assert [c for c in calls if c[0] == "in_process"] == [("in_process", "1.7B"), ("in_process", "4B"),
                                                           ("in_process", "8B")]
    assert made == ["1.7B", "4B", "8B"]  # the full shape's first; each headline shape's at its first item
    assert summary["shapes"] == ["1.7B", "4B", "8B"] and summary["headline_shapes"] == ["4B", "8B"]
    # the targets read the headline shapes' figures under their usual keys (recorded here: no figure)
    assert {t["what"] for t in summary["targets"]} >= {"LoRA 8x1024, 8B (MFU 4NT)", "decode, 256 rows, 8B (tok/s)"}


def test_a_headline_shape_whose_items_do_not_run_makes_no_checkpoint(recorded, tmp_path):
    calls, made = recorded
    summary = _main(tmp_path, "--shapes", "1.7B", "--headline-shapes", "8B", "--only", "1.7B/decode$,8B/lora$")
    assert list(summary["train"]) == ["8B/lora"] and list(summary["sample"]) == ["1.7B/decode"]
    assert made == ["1.7B", "8B"]
    summary = _main(tmp_path, "--shapes", "1.7B", "--headline-shapes", "8B", "--only", "1.7B/decode$")
    assert made[2:] == ["1.7B"]  # no 8B item ran: no 8B checkpoint


def test_headline_alone_keeps_its_order(recorded, tmp_path):
    calls, _ = recorded
    summary = _main(tmp_path, "--shapes", "4B,8B", "--headline")
    assert list(summary["train"]) == ["4B/lora", "8B/lora"] and list(summary["sample"]) == ["4B/decode", "8B/decode"]
    assert {name for name, _ in calls} == {"lora_headline", "in_process"}


@pytest.mark.parametrize("args, message", [
    (("--headline-shapes", "9B"), "--headline-shapes: unknown ['9B']"),
    (("--shapes", "1.7B", "--headline-shapes", "1.7B"), "--headline-shapes: ['1.7B'] also in --shapes"),
])
def test_bad_headline_shapes_are_refused_by_name(recorded, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        _main(tmp_path, *args)
    assert message in capsys.readouterr().err
