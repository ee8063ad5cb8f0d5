"""A custom loss inside the batched forward/backward of the runtime, beside other tenants.

A loss that passes its dry run (stand-in logprobs) can still fail on the real logprobs when its
shapes depend on their values; then it fails alone: its pass's gradients are put back and the
other requests of the micro-batch train exactly as if it had not been there.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tests.custom_losses.losses import LOSSES
from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.custom_losses import BoundCustomLoss, RunLimits, decode_custom_loss
from tinsmith.errors import InvalidInputError
from tinsmith.models.loading import load_model
from tinsmith.types import Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

VOCAB = 512
LIMITS = RunLimits(max_elements=1 << 20, timeout_s=5.0)


@pytest.fixture()
def rt(qwen3_dir):
    return TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=4, max_lora_rank=16)


def bound(fn, ranks) -> BoundCustomLoss:
    handle = trace_loss(fn, ranks, "s")
    graph = json.loads(encode_graph(handle).model_dump_json())
    loss = decode_custom_loss(handle.name, [x.model_dump() for x in handle.inputs], graph, max_nodes=100)
    return BoundCustomLoss("s:loss:0", loss, LIMITS)


def custom_input(data, custom) -> ForwardBackwardInput:
    return ForwardBackwardInput(data, "custom", {"loss_id": custom.loss_id}, custom_loss=custom)


def grads(rt, unit):
    return {n: None if p.grad is None else p.grad.clone() for n, p in rt.unit(unit).named_params}


def confident_only(logprobs, weights):
    """Only tokens the model already predicts well: shapes depend on the logprobs' values."""
    picked = logprobs[logprobs > -2.0]
    return -(picked * weights).sum(), {}


def test_custom_loss_gradient_equals_the_same_loss_written_as_cross_entropy(rt):
    """weighted_nll is cross_entropy by another name: same loss, same gradients."""
    rng = np.random.default_rng(1)
    a, b = rt.create_adapter(LoraSpec(rank=4, seed=1)), rt.create_adapter(LoraSpec(rank=4, seed=1))
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (9, 14)]
    custom, plain = rt.forward_backward([TrainRequest(a, custom_input(data, bound(*LOSSES["weighted_nll"]))),
                                         TrainRequest(b, ForwardBackwardInput(data, "cross_entropy"))])
    assert custom.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
    assert "elementwise_loss" not in custom.outputs[0]
    ga, gb = grads(rt, a), grads(rt, b)
    for n in gb:
        if gb[n] is not None:
            assert_rel_close(ga[n], gb[n], 1e-5, n)


def test_a_loss_failing_on_real_logprobs_fails_alone(rt):
    rng = np.random.default_rng(2)
    hostile, honest = rt.create_adapter(LoraSpec(rank=4, seed=1)), rt.create_adapter(LoraSpec(rank=4, seed=2))
    bad = bound(confident_only, {"logprobs": 1, "weights": 1})
    # the dry run (stand-in logprobs of -1, all "confident") passes; the random model's real
    # logprobs (about -6) pick nothing, and picked * weights cannot broadcast
    bad_data = [sft_datum(rng, 12, VOCAB)]
    good_data = [sft_datum(rng, n, VOCAB) for n in (10, 12)]
    before = grads(rt, hostile)
    results = rt.forward_backward([TrainRequest(hostile, custom_input(bad_data, bad)),
                                   TrainRequest(honest, ForwardBackwardInput(good_data, "cross_entropy"))])
    assert isinstance(results[0], InvalidInputError)
    assert "node 'mul'" in str(results[0]) and not str(results[0]).startswith("data[")  # not the dry run
    assert all(g is None for g in grads(rt, hostile).values()) and all(g is None for g in before.values())
    together = grads(rt, honest)
    rt.unit(honest).optimizer.zero_grad(set_to_none=True)
    (alone,) = rt.forward_backward([TrainRequest(honest, ForwardBackwardInput(good_data, "cross_entropy"))])
    assert results[1].metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
    for n, g in grads(rt, honest).items():
        if g is not None:
            assert_rel_close(together[n], g, 1e-6, n)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.loss_inputs.pop("weights"), r"data\[0\].loss_fn_inputs\['weights'\] is missing"),
    (lambda d: d.loss_inputs.update(weights=np.ones((12, 2), np.float32)), "has rank 2"),
    (lambda d: d.loss_inputs.update(weights=np.full(12, np.nan, np.float32)), "NaN"),
    (lambda d: d.loss_inputs.update(weights=np.ones(5, np.float32)), r"data\[0\]: custom loss .* node"),
])
def test_bad_inputs_are_refused_before_anything_runs(rt, mutate, match):
    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    datum: Datum = sft_datum(np.random.default_rng(3), 12, VOCAB)
    mutate(datum)
    (res,) = rt.forward_backward([TrainRequest(unit, custom_input([datum], bound(*LOSSES["weighted_nll"])))])
    assert isinstance(res, InvalidInputError) and re.search(match, str(res)), res
    assert all(g is None for g in grads(rt, unit).values())


def test_a_detached_loss_has_nothing_to_train(rt):
    def detached(logprobs):
        return logprobs.detach().sum(), {}

    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    datum = sft_datum(np.random.default_rng(3), 6, VOCAB)
    (res,) = rt.forward_backward([TrainRequest(unit, custom_input([datum], bound(detached, {"logprobs": 1})))])
    assert isinstance(res, InvalidInputError) and "does not depend on logprobs" in str(res)
    assert torch.is_grad_enabled()


def test_the_time_limit_covers_all_runs_of_a_request(rt, monkeypatch):
    """A clock that moves 10 ms per reading: one datum fits in the budget, thirty do not, even
    though each datum alone would; so no request holds the worker past its budget."""
    import time as time_module

    now = [0.0]

    def ticking() -> float:
        now[0] += 0.01
        return now[0]

    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    fn, ranks = LOSSES["weighted_nll"]
    rng = np.random.default_rng(4)
    short = RunLimits(max_elements=1 << 20, timeout_s=0.5)
    one, many = [sft_datum(rng, 6, VOCAB)], [sft_datum(rng, 6, VOCAB) for _ in range(30)]
    bound(fn, ranks)  # decode (and warm up) before the clock is replaced
    monkeypatch.setattr(time_module, "monotonic", ticking)
    b1 = BoundCustomLoss("s:loss:0", bound(fn, ranks).loss, short)
    (ok,) = rt.forward_backward([TrainRequest(unit, custom_input(one, b1))])
    assert not isinstance(ok, Exception), ok
    b30 = BoundCustomLoss("s:loss:0", bound(fn, ranks).loss, short)
    (late,) = rt.forward_backward([TrainRequest(unit, custom_input(many, b30))])
    assert isinstance(late, InvalidInputError) and "time limit of 0.5 s (all its runs for one request)" in str(late)
    assert str(late).startswith("data[") and not str(late).startswith("data[0]")  # stopped by the shared budget
