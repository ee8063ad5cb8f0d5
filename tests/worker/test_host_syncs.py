"""A training step waits for the device a fixed number of times, however many datums, tenants and layers.

See :mod:`tinsmith.devtools.host_syncs`: on a GPU each read of a device value and each blocking
host-to-device copy drains the launch queue. A forward/backward copies its inputs without
waiting, reads each request's outputs and metrics back once, and an optimizer step reads its
gradient norm once.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinsmith.models.moe as moe
from tests.worker.helpers import sft_datum
from tinsmith.devtools.host_syncs import HostSyncs
from tinsmith.losses import LOSSES
from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest


def _rl_datum(rng: np.random.Generator, n: int, sequence_mask: bool = False) -> Datum:
    t = rng.integers(0, 512, n + 1)
    inputs = {"target_tokens": t[1:], "logprobs": rng.normal(-2, 0.1, n).astype(np.float32),
              "advantages": rng.normal(0, 1, n).astype(np.float32)}
    if sequence_mask:  # gspo's: which tokens enter a sequence's ratio
        inputs["sequence_ratio_mask"] = (rng.random(n) < 0.8).astype(np.float32)
    return Datum(tokens=t[:-1], loss_inputs=inputs)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_waits_per_request_do_not_grow_with_datums_or_tenants(family, qwen3_dir, qwen3_moe_dir, monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")  # as bf16 on a GPU: no per-expert loop
    rt = TrainingRuntime(load_model(str(qwen3_moe_dir if family == "qwen3_moe" else qwen3_dir)).model,
                         max_lora_adapters=8, max_lora_rank=16)
    units = [rt.create_adapter(LoraSpec(rank=8, seed=i)) for i in range(4)]
    rng = np.random.default_rng(0)

    def step(tenants: int, datums: int, loss: str) -> HostSyncs:
        make = sft_datum if loss == "cross_entropy" else (lambda r, n, v: _rl_datum(r, n, loss == "gspo"))
        reqs = [TrainRequest(u, ForwardBackwardInput([make(rng, 12 + 5 * i, 512) for i in range(datums)], loss))
                for u in units[:tenants]]
        with HostSyncs() as h:
            results = rt.forward_backward(reqs)
        assert not any(isinstance(r, Exception) for r in results), results
        return h

    for loss in ("cross_entropy", "importance_sampling") if family == "qwen3_moe" else sorted(LOSSES):
        small, large = step(1, 2, loss), step(4, 6, loss)
        assert small.count("copy") == large.count("copy") == 0, (loss, large.by_site())
        # Per request its metrics and its outputs, one read each (the backward takes the loss
        # only: its metrics are never read); the micro-batch's chunk bounds are found on the host.
        assert small.count("read") == 2 * 1, (loss, small.by_site())
        assert large.count("read") == 2 * 4, (loss, large.by_site())
    for u in units:  # the optimizer's state made, then a step over it
        rt.optim_step(u, AdamParams(learning_rate=1e-3))
    step(4, 2, "cross_entropy")
    with HostSyncs() as h:
        for u in units:
            rt.optim_step(u, AdamParams(learning_rate=1e-3))
    assert h.count("copy") == 0 and h.count("read") == len(units), h.by_site()  # the gradient norm
