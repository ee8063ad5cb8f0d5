"""Running out of device memory in a training step: the micro-batch is split and run again, the
results are those of a step that fitted, and a sequence too large on its own fails alone.

The device's limit is played by the model raising ``torch.OutOfMemoryError`` (what CUDA's
allocator raises) above a number of (padded, or packed) tokens, in the forward or halfway through
the backward. Both micro-batch layouts are tried: padded rows and packed documents.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.errors import CapacityError
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

VOCAB = 512


def _runtime(qwen3_dir, packing: bool = False) -> tuple[TrainingRuntime, list[int]]:
    rt = TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=4, max_lora_rank=8,
                         micro_batch_tokens=4096, packing=packing)
    rt.oom_retry = True
    units = [rt.create_adapter(LoraSpec(rank=4, seed=s, train_unembed=True)) for s in (1, 2)]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for u in units:
            for n, p in rt.unit(u).named_params:
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return rt, units


def _requests(units: list[int], lengths=((30, 12, 25), (18, 40))) -> list[TrainRequest]:
    """One request per unit; request i's datums drawn from seed i (the same whatever the others)."""
    return [TrainRequest(u, ForwardBackwardInput([sft_datum(np.random.default_rng(i), n, VOCAB, signed=True)
                                                  for n in ls], "cross_entropy"))
            for i, (u, ls) in enumerate(zip(units, lengths))]


def _step(rt: TrainingRuntime, units: list[int], requests: list[TrainRequest]):
    results = rt.forward_backward(requests)
    grads = {(u, n): p.grad.clone() for u in units for n, p in rt.unit(u).named_params if p.grad is not None}
    return results, grads


def _assert_same_step(results, grads: dict, expected, expected_grads: dict) -> None:
    """A step's logprobs and gradients are those of the step that fitted (gradients summed over
    other micro-batches: equal up to summation order)."""
    for a, b in zip(results, expected):
        assert not isinstance(a, Exception), a
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
    assert set(grads) == set(expected_grads)
    for key, g in expected_grads.items():
        assert_rel_close(grads[key], g, 1e-5, str(key))


def _device_limit(rt: TrainingRuntime, max_padded_tokens: int, where: str, checkpointing_fits: bool = False
                  ) -> list[int]:
    """Micro-batches above ``max_padded_tokens`` run out of memory: at once in the forward, or in
    the backward when it reaches the first layer (the later layers' and the unembedding's LoRA
    gradients are added by then); with ``checkpointing_fits``, not when they recompute their
    activations. Returns the padded sizes of the micro-batches tried."""
    real, calls, armed = rt.model.hidden_states, [], [False]

    def hidden_states(tokens, *args, **kwargs):
        calls.append(tokens.numel())
        too_big = tokens.numel() > max_padded_tokens and not (checkpointing_fits and rt.model.gradient_checkpointing)
        if too_big and where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        armed[0] = too_big and torch.is_grad_enabled()
        return real(tokens, *args, **kwargs)

    def fail(grad):
        if armed[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return grad

    for w in rt.model.model.layers[0].self_attn.q_proj.adapters.values():
        w.A.register_hook(fail)
    rt.model.hidden_states = hidden_states
    return calls


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_micro_batches_give_the_results_of_one_that_fits(qwen3_dir, where, packing):
    rt, units = _runtime(qwen3_dir, packing)
    expected, expected_grads = _step(rt, units, _requests(units))
    rt2, units2 = _runtime(qwen3_dir, packing)
    assert units2 == units
    calls = _device_limit(rt2, 90, where)
    results, grads = _step(rt2, units, _requests(units))
    assert max(calls) > 90 and len(calls) > 2, calls  # it ran out, then ran smaller pieces
    assert rt2.micro_batch_tokens < 4096  # later steps plan smaller micro-batches
    _assert_same_step(results, grads, expected, expected_grads)


@pytest.mark.parametrize("packing", [False, True])
def test_a_sequence_that_fits_only_with_checkpointing_is_run_again_with_it(qwen3_dir, packing):
    rt, units = _runtime(qwen3_dir, packing)
    expected, expected_grads = _step(rt, units, _requests(units, lengths=((40,), (12, 9))))
    rt2, _ = _runtime(qwen3_dir, packing)
    calls = _device_limit(rt2, 35, "forward", checkpointing_fits=True)
    results, grads = _step(rt2, units, _requests(units, lengths=((40,), (12, 9))))
    assert calls.count(40) == 2  # out of memory once, then recomputing activations
    assert not rt2.model.gradient_checkpointing and not rt2._checkpoint_rows
    _assert_same_step(results, grads, expected, expected_grads)


def test_micro_batches_above_the_planned_size_recompute_activations(qwen3_dir):
    """A single sequence longer than a planned micro-batch recomputes the activations of as few
    layers as bring it down to the planned size's activation memory (the planner sized
    micro-batches for activations kept whole): a little over it, one of the four layers; five
    times over, all of them; the others none."""
    rt, units = _runtime(qwen3_dir)
    rt.micro_batch_tokens, rt.checkpoint_above_tokens = 32, 32
    seen: list[tuple[int, bool, frozenset]] = []
    real = rt.model.hidden_states

    def hidden_states(tokens, *args, **kwargs):
        seen.append((tokens.numel(), rt.model.gradient_checkpointing, rt.model.recomputed_layers))
        return real(tokens, *args, **kwargs)

    rt.model.hidden_states = hidden_states
    results = rt.forward_backward(_requests(units, lengths=((40, 160), (12, 9))))
    assert all(not isinstance(r, Exception) for r in results)
    by_size = {n: (every, some) for n, every, some in seen}
    assert by_size[40] == (False, frozenset({0})), seen
    assert by_size[160][0], seen
    assert all(by_size[n] == (False, frozenset()) for n in by_size if n <= 32), seen
    assert not rt.model.gradient_checkpointing and not rt.model.recomputed_layers


def test_a_sequence_too_large_alone_fails_its_request_only(qwen3_dir):
    rt, units = _runtime(qwen3_dir)
    expected, _ = _step(rt, units, _requests(units, lengths=((20,), (12, 9))))
    rt2, _ = _runtime(qwen3_dir)
    _device_limit(rt2, 35, "forward")
    res_big, res_small = rt2.forward_backward(_requests(units, lengths=((40,), (12, 9))))
    assert isinstance(res_big, CapacityError)
    assert "a sequence of 40 tokens does not fit in device memory on its own even with its activations " \
        "recomputed" in res_big.message
    assert all(p.grad is None or not p.grad.any() for p in rt2.unit(units[0]).params)
    assert not isinstance(res_small, Exception)
    for x, y in zip(res_small.outputs, expected[1].outputs):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)


def test_without_retry_the_error_fails_the_call_as_before(qwen3_dir):
    """Devices that never report running out (a CPU) keep the plain path: no gradient copies."""
    rt, units = _runtime(qwen3_dir)
    rt.oom_retry = False
    _device_limit(rt, 10, "forward")
    results = rt.forward_backward(_requests(units))
    assert all(isinstance(r, torch.OutOfMemoryError) for r in results)


def test_memory_idle_samplers_keep_is_given_back_before_a_micro_batch_is_split(qwen3_dir):
    """Out of memory while idle samplers keep theirs (their K/V buffers, for the next sampling
    phase): that memory is given back and the micro-batch runs again whole, later ones planned as
    before. When nothing is left to give back, the micro-batch is split as usual."""
    rt, units = _runtime(qwen3_dir)
    expected, expected_grads = _step(rt, units, _requests(units))
    rt2, _ = _runtime(qwen3_dir)
    limit, calls, kept = [90], [], [1 << 30]
    real = rt2.model.hidden_states

    def hidden_states(tokens, *args, **kwargs):
        calls.append(tokens.numel())
        if tokens.numel() > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(tokens, *args, **kwargs)

    def release() -> int:
        released, kept[0] = kept[0], 0
        if released:
            limit[0] = 1 << 20  # the samplers' memory is free again
        return released

    rt2.model.hidden_states = hidden_states
    rt2.release_memory = release
    results, grads = _step(rt2, units, _requests(units))
    assert calls[0] == calls[1] > 90, calls  # the same micro-batch, whole, once the memory came back
    assert rt2.micro_batch_tokens == 4096
    _assert_same_step(results, grads, expected, expected_grads)
    limit[0], calls[:] = 90, []
    results = rt2.forward_backward(_requests(units))
    assert all(not isinstance(r, Exception) for r in results)
    assert max(calls) > 90 and len(calls) > 2 and rt2.micro_batch_tokens < 4096  # nothing kept: split
