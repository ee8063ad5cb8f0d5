"""Packed training micro-batches under tensor parallelism: each rank attends per document over its
own heads, and two ranks give what one process gives with padded rows (the logprobs, and after an
optimizer step the logprobs again, which the gradients moved)."""

from __future__ import annotations

import numpy as np

from tests.worker.helpers import sft_datum
from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.service import RuntimeOptions, Worker


def _step(model_dir, tp: int, packing: str):
    """Logprobs of one uneven batch before and after a step on it."""
    w = Worker(RuntimeOptions(device="cpu", dtype="float32", tensor_parallel_size=tp, packing=packing))
    try:
        base = w.add_base_model("m", str(model_dir))
        assert base.lora.packing is (packing == "on")
        w.create_model("run", "m", LoraSpec(rank=4, seed=3))
        rng = np.random.default_rng(0)
        data = [sft_datum(rng, n, 512) for n in (3, 29, 11, 40, 1)]
        out = []
        for _ in range(2):
            fb = w.fb_begin("run", [ForwardBackwardInput(data, "cross_entropy")])
            w.fb_advance([(fb, 1 << 20)], 1 << 20)
            out += [o["logprobs"] for o in fb.results[0].outputs]
            w.optim_step("run", AdamParams(learning_rate=1e-2))
        return out
    finally:
        w.close()


def test_packed_tensor_parallel_step_equals_padded_single_process(qwen3_dir):
    for a, b in zip(_step(qwen3_dir, 2, "on"), _step(qwen3_dir, 1, "off"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
