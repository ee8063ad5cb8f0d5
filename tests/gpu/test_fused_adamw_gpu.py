"""AdamW's fused kernel on the device: LoRA training steps equal the foreach optimizer's (what
a CPU runs) within fp32 rounding, through an adapter parked off the device and back and a
saved state loaded into a fresh run; the step counts follow the parameters' device."""

from __future__ import annotations

import pytest
import torch

from bench.gpu.train import batch, training_step
from tests.gpu.conftest import DEVICE
from tinsmith.models.loading import load_model
from tinsmith.optim import families
from tinsmith.types import LoraSpec
from tinsmith.worker.runtime import TrainingRuntime

pytestmark = pytest.mark.gpu
FITS = families.fused_adamw_fits  # the real check


def _weights(rt: TrainingRuntime, unit: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in rt.unit(unit).named_stepped}


def _run(model_dir, fused: bool, monkeypatch) -> tuple[dict, dict]:
    """Two adapters on a one-slot runtime (each step parks the other), three steps each; then the
    first one's state exported, loaded into a fresh adapter and stepped once more."""
    monkeypatch.setattr(families, "fused_adamw_fits", lambda params: fused and FITS(params))
    device = torch.device(DEVICE)
    model = load_model(str(model_dir), device=device).model
    rt = TrainingRuntime(model, max_lora_adapters=1, max_lora_rank=8)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(2)]
    vocab = model.config.vocab_size
    for _ in range(3):
        for i, u in enumerate(units):
            training_step(rt, {u: batch(vocab, 2, 16, seed=i)})()
    if device.type == "cuda":  # the last step's adapter is on the device, the other parked on the host
        resident, parked = rt.unit(units[1]).optimizer, rt.unit(units[0]).optimizer
        assert families.steps_on_device(resident) == fused
        assert all(st["step"].device.type == ("cuda" if fused else "cpu") for st in resident.state.values())
        assert all(st["step"].device.type == "cpu" for st in parked.state.values())
    weights, optimizer = rt.unit(units[0]).export_state()
    fresh = rt.create_adapter(LoraSpec(rank=8, seed=9))
    rt.unit(fresh).import_state(weights, optimizer)
    training_step(rt, {fresh: batch(vocab, 2, 16, seed=0)})()
    return _weights(rt, units[1]), _weights(rt, fresh)


def test_fused_adamw_steps_as_the_foreach_optimizer(qwen3_dir, monkeypatch):
    got = _run(qwen3_dir, True, monkeypatch)
    want = _run(qwen3_dir, False, monkeypatch)
    for g, w in zip(got, want):
        for name in w:
            err = float((g[name] - w[name]).abs().max() / w[name].abs().max().clamp(min=1e-12))
            assert err < 1e-4, (name, err)
