"""Training steps and sampling leave no reference cycles behind.

A serving process collects young objects only every 10,000 allocations (tinsmith.gc_tuning), so an
activation held by a reference cycle (a custom autograd node keeping its own output on ``ctx``,
an exception kept with its frames) would stay in device memory for several steps instead of one.
Here every object such work leaves for the cyclic collector is kept and counted: there must be none.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from bench.gpu.train import batch
from tinsmith.models import grouped_lora
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest


@contextmanager
def cyclic_garbage() -> Iterator[list]:
    """Tensors, and objects of torch's or this project's types, that only the cyclic collector
    would free, made inside the block. The collector sees the whole process: other threads of the
    test process (an SDK client's heartbeat left by an earlier test) make cycles of their own,
    which hold no tensors and are not this test's business."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list = []
    try:
        yield found
        gc.collect()
        found.extend(o for o in gc.garbage
                     if isinstance(o, torch.Tensor) or type(o).__module__.split(".")[0] in ("torch", "tinsmith"))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("multi_lora", ["auto", "grouped"])
def test_training_steps_of_several_tenants_leave_no_cycles(qwen3_dir, monkeypatch, multi_lora):
    monkeypatch.setattr(grouped_lora, "MULTI_LORA", multi_lora)  # "grouped": the GPU's several-tenant path
    rt = TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=4, max_lora_rank=8)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(3)]
    requests = [TrainRequest(u, ForwardBackwardInput(batch(rt.config.vocab_size, 2, 12, seed=i), "cross_entropy"))
                for i, u in enumerate(units)]
    rt.forward_backward(requests)  # first step: stacks, optimizer state
    rt.optim_steps([(u, AdamParams(learning_rate=1e-3)) for u in units])
    with cyclic_garbage() as garbage:
        for _ in range(2):
            rt.forward_backward(requests)
            for res in rt.optim_steps([(u, AdamParams(learning_rate=1e-3)) for u in units]):
                assert not isinstance(res, Exception), res
    tensors = [o for o in garbage if isinstance(o, torch.Tensor)]
    assert not garbage, f"{len(garbage)} objects in cycles ({len(tensors)} tensors), e.g. {garbage[:5]!r:.500}"


def test_sampling_leaves_no_cycles(qwen3_dir):
    lm = load_model(str(qwen3_dir))
    sampler = Sampler(lm.model, lambda toks: "", max_rows=8)

    def sample(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(6):
            params = SamplingParams(max_tokens=12, temperature=1.0, stop=[], seed=seed + i)
            sampler.add(SampleTask(i, None, SampleInput(prompt=rng.integers(4, 200, 20), num_samples=2, params=params)))
        finished = 0
        with torch.inference_mode():
            while finished < 6:
                for _, res in sampler.step():
                    assert not isinstance(res, Exception), res
                    finished += 1

    sample(0)
    with cyclic_garbage() as garbage:
        sample(1)
    assert not garbage, f"{len(garbage)} objects in cycles, e.g. {garbage[:5]!r:.500}"
