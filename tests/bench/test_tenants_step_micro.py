"""bench/tenants_step_micro.py's host-only columns: the grouped matmul's share of a several-tenant
forward/backward, and the optimizer steps timed with their kernels skipped, which must leave the
weights as they were and put torch's functions back; ``--nodes-from``'s nodes and ``--steps-from``'s
joint optimizer steps of another commit beside this checkout's; ``--single-steps``' two ways of
one tenant's step."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from tinsmith.kernels import block_copy
from tinsmith.models import grouped_lora, lora, lora_tenants, moe
from tinsmith.models.loading import load_model
from tinsmith.optim import families
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tenants_step_micro.py"


def _bench():
    spec = importlib.util.spec_from_file_location("tenants_step_micro", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _grouped_runtime(qwen3_dir, monkeypatch) -> TrainingRuntime:
    """A runtime on the paths a GPU takes, as the bench forces them (grouped matmul, fused AdamW)."""
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    monkeypatch.setattr(grouped_lora, "MULTI_LORA", "grouped")
    monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)  # as the bench runs it (a GPU's AdamW)
    return TrainingRuntime(load_model(str(qwen3_dir), dtype=torch.float32).model, max_lora_adapters=4, max_lora_rank=8)


def _needs_git(flag: str) -> None:
    if not (SCRIPT.parents[1] / ".git").exists():
        pytest.skip(f"{flag} reads a commit: not a git checkout")


def test_both_columns_are_timed_and_the_step_under_skipped_kernels_moves_nothing(qwen3_dir, monkeypatch):
    bench = _bench()
    rt = _grouped_runtime(qwen3_dir, monkeypatch)
    real = {name: getattr(torch, name) for name in (*bench._STEP_KERNELS, "_foreach_norm", "_grouped_mm")}
    run = block_copy.BlockCopies.run

    out = bench.time_steps(rt, 2, steps=1, rows=2, length=8, rank=8, together=True)
    assert out["grouped_mm_ms"] > 0  # two tenants' rows went through the grouped matmul
    assert 0 < out["optimizer_host_ms"] < 1e4
    assert {name: getattr(torch, name) for name in real} == real  # put back
    assert block_copy.BlockCopies.run is run

    # A step taken with the kernels skipped leaves the weights as they were; the same step with
    # them moves the weights (so the first check could fail).
    unit = rt.create_adapter(LoraSpec(rank=8, seed=0))
    units = [unit]
    rows = bench.batch(rt.config.vocab_size, 2, 8)
    request = [TrainRequest(unit, ForwardBackwardInput(rows, "cross_entropy"))]
    before = [p.detach().clone() for p in rt.unit(unit).params]
    rt.forward_backward(request)
    with bench.optimizer_kernels_skipped():
        bench.optimizer_steps(rt, units, True)
    assert all(torch.equal(a, p) for a, p in zip(before, rt.unit(unit).params))
    rt.forward_backward(request)
    bench.optimizer_steps(rt, units, True)
    assert not all(torch.equal(a, p) for a, p in zip(before, rt.unit(unit).params))


def test_nodes_of_another_commit_run_beside_this_checkouts_and_the_layers_get_these_back(qwen3_dir, tmp_path,
                                                                                          monkeypatch):
    bench = _bench()
    _needs_git("--nodes-from")
    rt = _grouped_runtime(qwen3_dir, monkeypatch)
    then = bench.nodes_of("HEAD", tmp_path)
    assert then.tenants_linear is not lora_tenants.tenants_linear  # a module of its own
    ran = []
    real = then.tenants_group
    monkeypatch.setattr(then, "tenants_group", lambda *a, **k: ran.append(1) or real(*a, **k))
    results = {}
    args = argparse.Namespace(nodes_from="HEAD", tenants="2", rounds=1, steps=1, widths=16)
    bench.compare_nodes(rt, args, then, results)
    assert ran  # the other commit's nodes took the layers' groups
    assert set(results[2]) == {"HEAD", "this checkout"}
    assert all(r["steps"] == 1 and r["median_ms"] > 0 for r in results[2].values())
    assert lora.tenants_linear is lora_tenants.tenants_linear and lora.tenants_group is lora_tenants.tenants_group


def test_joint_steps_of_another_commit_run_beside_this_checkouts_and_these_are_put_back(qwen3_dir, tmp_path,
                                                                                         monkeypatch):
    from tinsmith.models import copy_refresh
    from tinsmith.worker import joint_steps, runtime

    bench = _bench()
    _needs_git("--steps-from")
    rt = _grouped_runtime(qwen3_dir, monkeypatch)
    then = bench.module_of("HEAD", "tinsmith/worker/joint_steps.py", tmp_path)
    assert then.step_together is not joint_steps.step_together  # a module of its own
    ran = []
    real = then.step_together
    load = bench.module_of
    monkeypatch.setattr(bench, "module_of", lambda rev, path, into: then if path.endswith("joint_steps.py")
                        else load(rev, path, into))
    mine = copy_refresh.CopyRefresh._write_keys
    monkeypatch.setattr(then, "step_together", lambda *a, **k: ran.append(1) or real(*a, **k))
    results = {}
    args = argparse.Namespace(steps_from="HEAD", tenants="2", rounds=2, steps=1, widths=16)
    bench.compare_steps(rt, args, tmp_path, results)
    assert ran  # the other commit's joint step took the steps
    assert set(results[2]) == {"HEAD", "this checkout"}
    assert all(r["full_ms_a_tenant"] > 0 and r["host_ms_a_tenant"] > 0 for r in results[2].values())
    assert runtime.step_together is joint_steps.step_together  # put back
    assert copy_refresh.CopyRefresh._write_keys is mine


def test_single_steps_time_torchs_optimizer_and_the_runtimes_step(qwen3_dir, monkeypatch):
    from tinsmith.worker.trainables import Trainable

    bench = _bench()
    rt = _grouped_runtime(qwen3_dir, monkeypatch)
    by_torch = []
    real = Trainable.step
    monkeypatch.setattr(Trainable, "step", lambda self, hp: by_torch.append(1) or real(self, hp))
    results = {}
    bench.compare_single_steps(rt, argparse.Namespace(rounds=2, steps=1, widths=16), results)
    assert set(results) == {"torch's optimizer", "runtime's optim_step"}
    assert all(r["full_ms"] > 0 and r["host_ms"] > 0 for r in results.values())
    assert len(by_torch) == 4  # torch's way: two rounds of one step, in full and with the kernels skipped
    assert not rt.units  # the tenant it made is gone
