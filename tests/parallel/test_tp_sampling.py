"""The serving sampler over a model sharded on 2 gloo ranks draws what one process draws: greedy
base-model tokens with prompt logprobs, seeded nucleus samples through a LoRA adapter, and a
prompt that reads an earlier one's K/V from the prefix cache. The mixture-of-experts models run
their experts split over the ranks; gpt-oss adds attention sinks and sliding windows; Qwen3.5
keeps each rank's Gated DeltaNet heads' recurrent states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.scenario import (assert_same, fair_share_rank_main, fair_share_scenario, inflight_rank_main,
                                    inflight_scenario, sample_rank_main, sample_scenario)
from tinsmith.models.loading import read_config
from tinsmith.parallel.launch import run_ranks


@pytest.mark.parametrize("fixture,ranks,layout", [
    ("qwen3_dir", 2, "auto"), ("qwen3_moe_dir", 2, "auto"), ("gpt_oss_dir", 2, "auto"), ("qwen3_5_dir", 2, "auto"),
    ("qwen3_dir", 4, "auto"),  # 4: two ranks per K/V head
    ("gpt_oss_dir", 2, "paged"),  # the layout on GPUs: pages (and prefix-cache pages) of each rank's heads, rings beside
])
def test_sharded_sampler_matches_one_process(request, fixture, ranks, layout, tmp_path):
    model_dir = str(request.getfixturevalue(fixture))
    ref = sample_scenario(model_dir, None, layout)
    outcomes = run_ranks(sample_rank_main, ranks, tmp_path, (model_dir, layout), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    if read_config(Path(model_dir)).supports_prefix_cache:  # hybrids keep no prompt K/V across requests
        assert int(ref[0]["cached_prompt_tokens"]) >= 128  # the prefix cache was read (same count on every rank)
    a, b = ref[2]["sequences"]
    assert not torch.equal(a[0], b[0])  # the two samples differ: really sampled, not greedy
    assert ref[0]["packed"]  # q/k/v or gate/up run as one GEMM (the ranks' shards too: compared below)
    for o in outcomes:
        assert_same(ref, o.result, f"rank {o.rank}")


@pytest.mark.parametrize("fixture,layout,gpu_paths", [
    ("qwen3_dir", "paged", False), ("qwen3_dir", "paged", True),  # adapters gathered, or through the banks
    ("qwen3_moe_dir", "paged", True),  # each rank's experts, every pair kept
    ("gpt_oss_dir", "auto", False),  # sinks, sliding-window rings
    ("qwen3_5_dir", "auto", False),  # each rank's Gated DeltaNet states
])
def test_sharded_static_decode_step_matches_one_process(request, fixture, layout, gpu_paths, tmp_path, monkeypatch):
    """The decode step a CUDA graph records (run uncaptured here), on every rank of a sharded
    sampler: rows padded to a bucket, K/V read up to the capacity, the collectives inside the
    step. Same draws as one process decoding eagerly."""
    from tests.parallel.scenario import take_gpu_paths
    from tinsmith.models import lora, moe

    model_dir = str(request.getfixturevalue(fixture))
    monkeypatch.setattr(moe, "GROUPED_MM", moe.GROUPED_MM)
    monkeypatch.setattr(lora, "DECODE_LORA", lora.DECODE_LORA)
    if gpu_paths:
        take_gpu_paths()
    ref = sample_scenario(model_dir, None, layout)
    outcomes = run_ranks(sample_rank_main, 2, tmp_path, (model_dir, layout, gpu_paths, True), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same(ref, o.result, f"rank {o.rank}")


def test_sharded_decode_waits_for_the_device_once_per_burst(qwen3_dir, tmp_path):
    """On every rank of a tensor-parallel sampler, an admission reads its first tokens back once
    and a decode burst its tokens and logprobs, nothing else: no blocking copy, no read inside a
    step (the collectives need none)."""
    from tests.parallel.scenario import host_waits_rank_main

    outcomes = run_ranks(host_waits_rank_main, 2, tmp_path, (str(qwen3_dir), "paged"), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        admission, bursts = o.result["admission"], o.result["bursts"]
        assert not any(site.startswith("copy") for site in [*admission, *bursts]), o.result
        assert sum(admission.values()) == 2 and sum(bursts.values()) == 2 * 3, o.result


@pytest.mark.parametrize("fixture", ["qwen3_moe_dir", "gpt_oss_dir"])
def test_expert_parallel_decode_keeps_every_pair_and_waits_for_nothing(request, fixture, tmp_path, monkeypatch):
    """On the GPU's paths (grouped matmul, adapters through the banks), a rank's range of experts
    prefills and decodes without cutting its pairs out (which reads where they start, at every
    layer): every pair is kept, the others' dropped at the end. Same draws as one process; an
    admission of base-model and adapter prompts waits for its first tokens only, a burst for its
    tokens and logprobs only."""
    from tests.parallel.scenario import host_waits_rank_main, take_gpu_paths
    from tinsmith.models import lora, moe

    model_dir = str(request.getfixturevalue(fixture))
    monkeypatch.setattr(moe, "GROUPED_MM", moe.GROUPED_MM)
    monkeypatch.setattr(lora, "DECODE_LORA", lora.DECODE_LORA)
    take_gpu_paths()
    ref = sample_scenario(model_dir, None, "paged")
    outcomes = run_ranks(sample_rank_main, 2, tmp_path / "same", (model_dir, "paged", True), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same(ref, o.result, f"rank {o.rank}")
    outcomes = run_ranks(host_waits_rank_main, 2, tmp_path / "waits", (model_dir, "paged", True), timeout_s=60,
                         deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        admission, bursts = o.result["admission"], o.result["bursts"]
        assert not any(site.startswith("copy") for site in [*admission, *bursts]), o.result
        assert sum(admission.values()) == 2 and sum(bursts.values()) == 2 * 3, o.result


def test_inflight_sampler_reads_the_weights_of_each_step(qwen3_dir, tmp_path):
    """A sharded run's optimizer step and load change its adapter's weights version on every rank,
    as in one process, so an inflight sampler's prefix cache never serves a prompt's K/V computed
    with the weights before the step: the same greedy prompt after a step and after a load gives
    what one process gives."""
    model_dir = str(qwen3_dir)
    ref = inflight_scenario(model_dir, None)
    assert bool(ref["versions_changed"].all())
    assert not torch.equal(ref["before"][1], ref["after_step"][1])  # the step moved the sampled logprobs
    outcomes = run_ranks(inflight_rank_main, 2, tmp_path, (model_dir,), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same(ref, o.result, f"rank {o.rank}")


@pytest.mark.parametrize("fixture", ["qwen3_dir", "qwen3_5_dir"])  # qwen3_5: rows with Gated DeltaNet states
def test_rows_taken_back_for_a_fair_share_alike_on_every_rank(request, fixture, tmp_path):
    """A key below its fair share takes a row back from long generations at the same decode step
    on both ranks (the wait is counted in decode steps, which every rank runs alike), and every
    request samples what one process samples."""
    model_dir = str(request.getfixturevalue(fixture))
    ref = fair_share_scenario(model_dir, None)
    assert int(ref["yielded_rows"]) == 1 and int(ref["light"]["done_at"]) < int(ref["b0"]["done_at"])
    outcomes = run_ranks(fair_share_rank_main, 2, tmp_path, (model_dir,), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
        assert_same(ref, o.result, f"rank {o.rank}")
