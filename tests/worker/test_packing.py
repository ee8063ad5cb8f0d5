"""Packed training micro-batches: one row of documents end to end, attention per document.

Packing is a layout, not a different computation: every test compares it with the padded
layout (same model, same adapters, same data) and asks for the same logprobs and LoRA
gradients in fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.custom_losses.losses import LOSSES
from tests.custom_losses.test_runtime import bound, custom_input
from tests.models.helpers import perturbed_adapter
from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.models.document_attention import DocumentAttention
from tinsmith.models.layers import masked_attention
from tinsmith.models.loading import load_model
from tinsmith.server.config import ConfigError, ServerConfig
from tinsmith.types import Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.batching import SequenceRef, batch_tokens, build_micro_batch, plan_micro_batches
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tinsmith.worker.service import RuntimeOptions, Worker

VOCAB = 512
LENGTHS = (3, 37, 9, 21, 1, 30)  # uneven, longer and shorter than gpt-oss's 16-token window


def _ref(i: int, length: int, slot: int | None, needs_grad: bool = True) -> SequenceRef:
    return SequenceRef((0, i), 0, slot, length, needs_grad)


# ----------------------------------------------------------------------------- layout
def test_packed_micro_batch_is_one_row_with_positions_restarting_per_document():
    rows = [_ref(0, 3, 2), _ref(1, 2, None), _ref(2, 4, 1), _ref(3, 1, 2)]
    arrays = [np.arange(r.length) + 10 * (i + 1) for i, r in enumerate(rows)]
    mb = build_micro_batch(rows, arrays, torch.device("cpu"), packed=True)
    # ordered by slot (base model first), each slot one contiguous run
    assert [r.slot for r in mb.rows] == [None, 1, 2, 2]
    assert mb.tokens.tolist() == [[20, 21, 30, 31, 32, 33, 10, 11, 12, 40]]
    assert mb.positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb.doc_bounds == mb.token_offsets == [0, 2, 6, 9, 10]
    assert mb.row_segments == mb.token_segments == [(None, 0, 2), (1, 2, 6), (2, 6, 10)]
    assert mb.valid is None
    assert batch_tokens(mb.rows, packed=True) == 10 and batch_tokens(mb.rows, packed=False) == 16


def test_packed_planner_bounds_real_tokens_and_sequences():
    seqs = [_ref(i, n, 0) for i, n in enumerate((100, 10, 10, 10, 60, 5))]
    padded = plan_micro_batches(seqs, max_tokens=120, max_seqs=8)
    packed = plan_micro_batches(seqs, max_tokens=120, max_seqs=8, packed=True)
    assert all(batch_tokens(g, True) <= 120 for g in packed)
    assert all(batch_tokens(g, False) <= 120 or len(g) == 1 for g in padded)
    assert len(packed) < len(padded)  # real tokens fit more per micro-batch
    assert sorted(s.request for g in packed for s in g) == sorted(s.request for s in seqs)
    assert [len(g) for g in plan_micro_batches(seqs, 1000, 2, packed=True)] == [2, 2, 2]
    alone = plan_micro_batches([_ref(0, 500, 0), _ref(1, 4, 0)], 100, 8, packed=True)
    assert [[s.length for s in g] for g in alone] == [[4], [500]]  # too long for the budget: its own batch


# ----------------------------------------------------------------------------- attention
def _block_diagonal_reference(q, k, v, bounds, sinks, window):
    """One masked attention over the whole row: same document, causal, inside the window."""
    T = q.shape[2]
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(np.diff(bounds)))
    i = torch.arange(T)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return masked_attention(q, k, v, allowed[None], sinks)


@pytest.mark.parametrize("sinks, window", [(False, None), (False, 5), (True, None), (True, 5)])
def test_document_attention_equals_a_block_diagonal_mask(sinks, window):
    g = torch.Generator().manual_seed(0)
    bounds = [0, 7, 8, 20, 31]
    q = torch.randn(1, 4, 31, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 31, 16, generator=g, dtype=torch.float64) for _ in range(2))
    s = torch.randn(4, generator=g, dtype=torch.float64) if sinks else None
    out = DocumentAttention(bounds)(0, q, k, v, sinks=s, window=window)
    torch.testing.assert_close(out, _block_diagonal_reference(q, k, v, bounds, s, window))


def test_document_attention_refuses_bounds_that_do_not_rise_or_do_not_cover_the_row():
    with pytest.raises(ValueError, match="rise"):
        DocumentAttention([0, 4, 4, 9])
    q = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="one row of 9"):
        DocumentAttention([0, 4, 9])(0, q, q, q)


# ----------------------------------------------------------------------------- runtime
def _train(model_dir, packing: bool, requests_of, **kwargs):
    """Run ``requests_of(units)`` on a fresh runtime with two perturbed adapters; the results and grads."""
    loaded = load_model(str(model_dir))
    rt = TrainingRuntime(loaded.model, vision=loaded.vision, packing=packing, max_lora_adapters=4, max_lora_rank=8,
                         **kwargs)
    units = [perturbed_adapter(rt, LoraSpec(rank=4, seed=s), s) for s in (5, 6)]
    results = rt.forward_backward(requests_of(units))
    for r in results:
        if isinstance(r, Exception):
            raise r
    grads = {(u, n): p.grad for u in units for n, p in rt.unit(u).named_params}
    return rt, results, grads


def _mixed_requests(units):
    """Two adapters, uneven lengths, SFT and RL losses, and a forward-only request, in one call."""
    rng = np.random.default_rng(3)
    sft = [sft_datum(rng, n, VOCAB, signed=True) for n in LENGTHS]
    rl = []
    for n in LENGTHS[::-1]:
        t = rng.integers(0, VOCAB, n + 1)
        rl.append(Datum(t[:-1], {"target_tokens": t[1:], "logprobs": -rng.random(n).astype(np.float32) * 3,
                                 "advantages": rng.normal(size=n).astype(np.float32)}))
    a, b = units
    return [TrainRequest(a, ForwardBackwardInput(sft, "cross_entropy")),
            TrainRequest(b, ForwardBackwardInput(rl, "importance_sampling")),
            TrainRequest(b, ForwardBackwardInput(sft[:3], "cross_entropy", forward_only=True))]


def _assert_same_training(packed, padded):
    (_, res_p, g_p), (_, res_q, g_q) = packed, padded
    for x, y in zip(res_p, res_q):
        for ox, oy in zip(x.outputs, y.outputs):
            np.testing.assert_allclose(ox["logprobs"], oy["logprobs"], rtol=1e-5, atol=1e-5)
        assert x.metrics["loss:sum"] == pytest.approx(y.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert g_p.keys() == g_q.keys()
    for key in g_q:
        assert_rel_close(g_p[key], g_q[key], 1e-5, str(key))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe"])
def test_packed_training_equals_padded(family, request):
    """Dense, mixture of experts, sinks and sliding windows, and hybrid Gated DeltaNet layers
    (whose convolution and delta rule must start afresh at each document)."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    packed = _train(model_dir, True, _mixed_requests)
    assert packed[0].packing
    _assert_same_training(packed, _train(model_dir, False, _mixed_requests))


def test_packed_micro_batches_and_checkpointing_equal_one_padded_batch(qwen3_dir):
    """Several packed micro-batches (a small token budget), with activations recomputed in backward."""
    small = _train(qwen3_dir, True, _mixed_requests, micro_batch_tokens=40, gradient_checkpointing=True)
    _assert_same_training(small, _train(qwen3_dir, False, _mixed_requests))


def test_custom_loss_trains_the_same_packed(qwen3_dir):
    rng = np.random.default_rng(4)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in LENGTHS]

    def requests(units):
        return [TrainRequest(units[0], custom_input(data, bound(*LOSSES["weighted_nll"]))),
                TrainRequest(units[1], ForwardBackwardInput(data[:2], "cross_entropy"))]

    _assert_same_training(_train(qwen3_dir, True, requests), _train(qwen3_dir, False, requests))


def test_hybrid_micro_batches_stay_bounded_by_padded_tokens(qwen3_dir, qwen3_5_dir):
    """Gated DeltaNet layers run a packed row's sequences as padded rows: a hybrid's packed
    micro-batches are planned (and split, and checkpointed) by their padded size."""
    dense = TrainingRuntime(load_model(str(qwen3_dir)).model, packing=True)
    hybrid = TrainingRuntime(load_model(str(qwen3_5_dir)).model, packing=True)
    assert dense.packing and dense.sized_by_real_tokens
    assert hybrid.packing and not hybrid.sized_by_real_tokens


def _with_images(model_dir):
    """``_mixed_requests`` plus datums with an image, for the first adapter and forward only."""
    from tests.parallel.test_tp_vision import _with_image

    loaded = load_model(str(model_dir))

    def requests_of(units):
        requests = _mixed_requests(units)
        pictured = []
        for seed in (1, 2):
            tokens, images = _with_image(loaded.vision, loaded.config.vision, seed)
            pictured.append(Datum(tokens[:-1], {"target_tokens": tokens[1:],
                                                "weights": np.ones(len(tokens) - 1, np.float32)}, images=images))
        return [TrainRequest(units[0], ForwardBackwardInput(requests[0].input.data + pictured[:1], "cross_entropy")),
                requests[1],
                TrainRequest(units[1], ForwardBackwardInput(requests[2].input.data + pictured[1:], "cross_entropy",
                                                            forward_only=True))]
    return requests_of


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_vl"])
def test_image_text_model_packs_text_and_pads_images_and_trains_the_same(family, request, monkeypatch):
    """A datum with images runs in a padded micro-batch of its own (its multimodal positions and
    image features are laid out per row); the text datums of the same call are packed."""
    from tinsmith.worker import runtime

    model_dir = request.getfixturevalue(f"{family}_dir")
    layouts: list[tuple[bool, bool]] = []  # (packed, holds an image) per micro-batch built
    build = runtime.build_micro_batch

    def recording(rows, arrays, device, packed=False):
        mb = build(rows, arrays, device, packed)
        layouts.append((mb.doc_bounds is not None, any(r.padded for r in rows)))
        return mb

    monkeypatch.setattr(runtime, "build_micro_batch", recording)
    packed = _train(model_dir, True, _with_images(model_dir))
    assert packed[0].model.supports_packing and packed[0].packing
    assert (True, False) in layouts and (False, True) in layouts and (True, True) not in layouts
    _assert_same_training(packed, _train(model_dir, False, _with_images(model_dir)))


def test_planner_keeps_padded_sequences_apart_and_sizes_them_padded():
    seqs = [_ref(i, n, 0) for i, n in enumerate((10, 20, 30))]
    seqs += [SequenceRef((1, i), 0, 0, n, True, padded=True) for i, n in enumerate((15, 35))]
    groups = plan_micro_batches(seqs, max_tokens=60, max_seqs=8, packed=True)
    assert all(len({s.padded for s in g}) == 1 for g in groups)
    assert sorted([s.length for s in g] for g in groups if g[0].padded) == [[15], [35]]  # 2 x 35 > 60 padded (50 real tokens)
    assert [[s.length for s in g] for g in groups if not g[0].padded] == [[10, 20, 30]]  # 60 real tokens
    mixed = [seqs[0], seqs[3]]
    assert batch_tokens(mixed, packed=True) == 30  # padded all the same
    mb = build_micro_batch(mixed, [np.arange(10), np.arange(15)], torch.device("cpu"), packed=True)
    assert mb.doc_bounds is None and mb.tokens.shape == (2, 15)


# ----------------------------------------------------------------------------- option
@pytest.mark.parametrize("value, packs", [("auto", True), ("ON", True), ("off", False)])
def test_train_packing_option_reaches_the_runtimes(value, packs, qwen3_dir, qwen3_vl_dir):
    config = ServerConfig(train_packing=value)
    worker = Worker(RuntimeOptions(packing=config.train_packing))
    base = worker.add_base_model("qwen3", str(qwen3_dir))
    assert base.lora.packing is packs
    worker.create_model("full", "qwen3", None)  # a full fine-tune packs as its base model's runs do
    assert worker.placements["full"].runtime.packing is packs
    assert worker.add_base_model("vl", str(qwen3_vl_dir)).lora.packing is packs  # its image datums run padded


def test_train_packing_option_refuses_other_values():
    with pytest.raises(ConfigError, match="--train-packing must be .auto., .on. or .off."):
        ServerConfig(train_packing="sometimes")
