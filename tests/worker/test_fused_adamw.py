"""AdamW's fused kernel (what CUDA parameters take; the CPU has one too, forced here) steps a LoRA
run as the foreach optimizer does, and what the model computes with follows each step: the fused
kernel writes the parameters without bumping their version counters, by which the bf16 compute
copies and several tenants' stacks know they are stale."""

from __future__ import annotations

import pytest
import torch

from bench.gpu.train import batch, training_step
from tinsmith.models.loading import load_model
from tinsmith.optim import families
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest


def _forward(rt: TrainingRuntime, unit: int, data) -> torch.Tensor:
    """The logprobs a forward (no backward) gives ``unit`` on ``data``."""
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", forward_only=True))])
    return torch.cat([torch.as_tensor(o["logprobs"]) for o in res.outputs])


@pytest.mark.parametrize("tenants", [1, 2])  # one adapter's copies; two adapters' stack
def test_a_fused_step_reaches_what_the_model_computes_with(qwen3_dir, monkeypatch, tenants):
    monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    model = load_model(str(qwen3_dir), dtype=torch.bfloat16).model  # bf16 compute copies of fp32 masters
    rt = TrainingRuntime(model, max_lora_adapters=4, max_lora_rank=8)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(tenants)]
    assert families.steps_on_device(rt.unit(units[0]).optimizer)
    vocab = model.config.vocab_size
    work = {u: batch(vocab, 2, 16, seed=i) for i, u in enumerate(units)}
    probe = batch(vocab, 2, 16, seed=7)
    before = _forward(rt, units[0], probe)
    for _ in range(2):
        training_step(rt, work)()
    after = _forward(rt, units[0], probe)
    assert not torch.equal(after, before)  # the steps are seen
    weights, optimizer = rt.unit(units[0]).export_state()
    fresh = rt.create_adapter(LoraSpec(rank=8, seed=9))
    rt.unit(fresh).import_state(weights, optimizer)
    torch.testing.assert_close(_forward(rt, fresh, probe), after, rtol=0, atol=0)  # the same weights, the same copies
