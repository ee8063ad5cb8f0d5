"""Several tenants' LoRA as grouped matmuls or as dense masked products (the GPU paths, forced
here) equals the per-adapter loop."""

from __future__ import annotations

import numpy as np
import torch

from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.models import moe
from tinsmith.models import grouped_lora, lora_tenants
from tinsmith.models.grouped_lora import dense_lora_add, grouped_lora_delta
from tinsmith.models.loading import load_model
from tinsmith.models.lora import LoraLinear
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

VOCAB = 512


def _step(qwen3_dir, mode: str, monkeypatch, calls: list | None = None, multi: str = "auto", device: str = "cpu",
          dtype: torch.dtype | None = None):
    """Three tenants' forward/backward in one step: their results and every adapter's gradients."""
    monkeypatch.setattr(moe, "GROUPED_MM", mode)
    monkeypatch.setattr(grouped_lora, "MULTI_LORA", multi)
    if calls is not None:
        real = torch._grouped_mm
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    rt = TrainingRuntime(load_model(str(qwen3_dir), device=device, dtype=dtype).model, max_lora_adapters=4,
                         max_lora_rank=16)
    g = torch.Generator().manual_seed(5)
    units = []
    for rank, seed in ((4, 1), (8, 2), (6, 3)):  # unequal ranks: padded to a common width of 8
        u = rt.create_adapter(LoraSpec(rank=rank, seed=seed, train_unembed=True))
        with torch.no_grad():
            for n, p in rt.unit(u).named_params:
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        units.append(u)
    reqs = [TrainRequest(u, ForwardBackwardInput([sft_datum(np.random.default_rng(i), n, VOCAB, signed=True)
                                                  for n in (20, 33)], "cross_entropy"))
            for i, u in enumerate(units)]
    results = rt.forward_backward(reqs)
    grads = {(u, n): p.grad.clone() for u in units for n, p in rt.unit(u).named_params}
    return results, grads


def assert_same_step(got, want) -> None:
    """Two ``_step`` results: the same logprobs, and every adapter's own gradients."""
    (results, grads), (want_results, want_grads) = got, want
    for a, b in zip(results, want_results):
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
    assert set(grads) == set(want_grads)
    for key, g in want_grads.items():
        assert_rel_close(grads[key], g, 1e-5, str(key))


def test_grouped_training_step_equals_the_loop(qwen3_dir, monkeypatch):
    loop = _step(qwen3_dir, "loop", monkeypatch)
    calls: list = []
    packed: list = []  # per q/k/v or gate/up group: whether its base ran as one GEMM over the packed weight
    real = lora_tenants.TenantsGroupFunction.apply
    monkeypatch.setattr(lora_tenants.TenantsGroupFunction, "apply", lambda *a: packed.append(a[4] is not None)
                        or real(*a))
    grouped = _step(qwen3_dir, "grouped", monkeypatch, calls)
    assert len(calls) >= 2 * 4 * 2  # shrink and expand of every projection (q/k/v, gate/up: one each) of both layers
    assert packed == [True] * 4  # q/k/v and gate/up of both layers, side by side
    assert_same_step(grouped, loop)


def test_dense_training_step_equals_the_loop(qwen3_dir, monkeypatch):
    """Every adapter's factors stacked, two products, other tenants' columns masked: the loop's
    logprobs and every adapter's own gradients (none leaks into another's)."""
    import tinsmith.models.lora as lora_module

    loop = _step(qwen3_dir, "loop", monkeypatch)
    calls: list = []
    real = grouped_lora.dense_lora_add
    monkeypatch.setattr(lora_module, "dense_lora_add", lambda *a: calls.append(1) or real(*a))
    dense = _step(qwen3_dir, "loop", monkeypatch, multi="dense")
    assert len(calls) >= 2 * 7  # every projection of both layers, at least
    assert_same_step(dense, loop)


def test_the_gpu_takes_grouped_products_where_they_run_else_dense_ones_for_few_tenants(monkeypatch):
    """``auto`` on a GPU: grouped where the grouped matmul runs; else dense while adapters x padded
    rank is at most DENSE_MAX_RANK, and the loop above it. A CPU: the loop."""
    gen = torch.Generator().manual_seed(0)
    layer = LoraLinear(16, 24)
    for slot in range(40):
        layer.add_adapter(slot, 8, 16.0, gen)
    ws = [layer.adapters[s] for s in range(40)]
    x = torch.zeros(4, 16)

    class OnGpu(torch.Tensor):
        is_cuda = True

    gpu_x = x.as_subclass(OnGpu)
    monkeypatch.setattr(moe, "GROUPED_MM", "loop")  # a GPU without the fast grouped matmul
    assert grouped_lora.multi_lora_path(gpu_x, ws[:2], 24) == "dense"
    assert grouped_lora.multi_lora_path(gpu_x, ws[:32], 24) == "dense"  # 32 x 8 = DENSE_MAX_RANK
    assert grouped_lora.multi_lora_path(gpu_x, ws[:33], 24) is None  # past it: the loop
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")  # one with it (Hopper): grouped for few and many
    assert grouped_lora.multi_lora_path(gpu_x, ws[:2], 24) == "grouped"
    assert grouped_lora.multi_lora_path(gpu_x, ws[:33], 24) == "grouped"
    monkeypatch.setattr(moe, "GROUPED_MM", "auto")
    assert grouped_lora.multi_lora_path(x, ws[:2], 24) is None  # a CPU: the loop
    assert grouped_lora.multi_lora_path(gpu_x, [ws[0], None], 24) is None  # one adapter: its own addmm
    monkeypatch.setattr(grouped_lora, "MULTI_LORA", "dense")
    assert grouped_lora.multi_lora_path(x, ws[:33], 24) == "dense"


def test_rows_without_an_adapter_get_nothing(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    layer = LoraLinear(16, 24)
    torch.nn.init.normal_(layer.weight)
    gen = torch.Generator().manual_seed(0)
    for slot, rank in ((0, 3), (1, 5)):
        w = layer.add_adapter(slot, rank, 2.0 * rank, gen)
        with torch.no_grad():
            w.B.normal_(generator=gen)
    x = torch.randn(10, 16, generator=gen)
    segments = [(0, 0, 3), (None, 3, 6), (1, 6, 10)]
    y = layer(x, segments)
    monkeypatch.setattr(moe, "GROUPED_MM", "loop")
    torch.testing.assert_close(y, layer(x, segments), rtol=1e-5, atol=1e-6)
    delta = grouped_lora_delta(x, [layer.adapters[0], None, layer.adapters[1]], [3, 3, 4], 24)
    assert not delta[3:6].any()
    base = torch.nn.functional.linear(x, layer.weight)
    dense = dense_lora_add(base, x, [layer.adapters[0], None, layer.adapters[1]], [3, 3, 4], 24)
    torch.testing.assert_close(dense, y, rtol=1e-5, atol=1e-6)
    assert torch.equal(dense[3:6], base[3:6])


def test_more_tenants_than_one_grouped_call_takes_run_adapter_by_adapter(qwen3_dir, monkeypatch):
    """Past the groups one grouped matmul takes (a GPU's refuses 1024 or more), a projection's
    tenants run one by one instead, with the same results (here: a limit of 2, three tenants)."""
    monkeypatch.setattr(moe, "MAX_GROUPS", 2)
    loop = _step(qwen3_dir, "loop", monkeypatch)
    calls: list = []
    grouped = _step(qwen3_dir, "grouped", monkeypatch, calls)
    assert not calls  # no dense projection took the grouped path with three tenants
    assert_same_step(grouped, loop)
