"""Running out of device memory for real: under a capped allocator a training step that does not
fit as one micro-batch is split and run again, gives the results of the step that fitted, leaves
the other tenant's request in the same call unharmed, and gives the memory back.

The CPU version (tests/worker/test_out_of_memory.py) has the model raise ``torch.OutOfMemoryError``;
here CUDA's caching allocator raises it, at a limit set with ``set_per_process_memory_fraction``.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.worker.helpers import sft_datum
from tinsmith.devtools.tiny_model import make_tiny_model
from tests.conftest import SMALL
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE != "cuda", reason="a real out-of-memory needs CUDA's allocator")]


def _requests(units: list[int]) -> list[TrainRequest]:
    rng = np.random.default_rng(0)
    big = [sft_datum(rng, 512, SMALL.vocab_size) for _ in range(16)]
    small = [sft_datum(rng, 64, SMALL.vocab_size) for _ in range(2)]
    return [TrainRequest(units[0], ForwardBackwardInput(big, "cross_entropy")),
            TrainRequest(units[1], ForwardBackwardInput(small, "cross_entropy"))]


def test_a_step_over_the_limit_is_split_and_its_neighbour_unharmed(tmp_path):
    model = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), device="cuda",
                       dtype=torch.bfloat16).model
    rt = TrainingRuntime(model, max_lora_adapters=2, max_lora_rank=8, micro_batch_tokens=1 << 20)
    rt.oom_retry = True
    units = [rt.create_adapter(LoraSpec(rank=8, seed=s)) for s in (1, 2)]
    reqs = _requests(units)

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    expected = rt.forward_backward(reqs)  # one micro-batch, nothing capped
    step_bytes = torch.cuda.max_memory_allocated() - base
    assert not any(isinstance(r, Exception) for r in expected)
    gc.collect()
    kept = torch.cuda.memory_allocated()  # what a step leaves (gradients, library workspaces)

    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + step_bytes // 2) / total))
    try:
        got = rt.forward_backward(reqs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert rt.micro_batch_tokens < 1 << 20, "the step fitted under the cap: nothing was split"
    for g, e in zip(got, expected):
        assert not isinstance(g, Exception), g
        for x, y in zip(g.outputs, e.outputs):  # bf16: other batch shapes may take other kernels
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=5e-2)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - kept < step_bytes // 4  # the failed micro-batch's tensors are gone
