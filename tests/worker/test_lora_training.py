"""Multi-LoRA forward/backward against transformers + peft, and the runtime's guarantees."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tinsmith.errors import CapacityError, InvalidInputError
from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tests.worker.helpers import assert_rel_close, dispatched, peft_grads, peft_reference, sft_datum

VOCAB = 512


@pytest.fixture()
def rt(qwen3_dir):
    return TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=4, max_lora_rank=16)


def _fb(rt, unit, data, loss="cross_entropy", forward_only=False, **cfg):
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, loss, cfg, forward_only))])
    if isinstance(res, Exception):
        raise res
    return res


def _grads(rt, unit):
    return {n: None if p.grad is None else p.grad.clone() for n, p in rt.unit(unit).named_params}


def _perturb_B(rt, unit, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in rt.unit(unit).named_params:
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_new_adapter_equals_base_model(rt):
    rng = np.random.default_rng(0)
    data = [sft_datum(rng, 40, VOCAB) for _ in range(3)]
    u = rt.create_adapter(LoraSpec(rank=8, seed=3))
    with_adapter = _fb(rt, u, data, forward_only=True)
    rt.delete_adapter(u)
    full = TrainingRuntime(rt.model, full_finetune=False)
    # Base model: forward through a fresh unit with B = 0 is exactly the base.
    v = full.create_adapter(LoraSpec(rank=2, seed=4, train_attn=False, train_mlp=False))
    base = _fb(full, v, data, forward_only=True)
    for a, b in zip(with_adapter.outputs, base.outputs):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])


def test_seeded_init_is_reproducible(qwen3_dir):
    def init(seed):
        r = TrainingRuntime(load_model(str(qwen3_dir)).model)
        return [p.detach().clone() for p in r.unit(r.create_adapter(LoraSpec(rank=4, seed=seed))).params]

    a, b, c = init(7), init(7), init(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("targets", [(True, True, True), (True, False, False), (False, True, True)])
def test_logprobs_and_grads_match_peft(rt, qwen3_dir, targets):
    attn, mlp, unembed = targets
    u = rt.create_adapter(LoraSpec(rank=8, alpha=16, seed=5, train_attn=attn, train_mlp=mlp, train_unembed=unembed))
    _perturb_B(rt, u, 11)  # non-zero B so every LoRA tensor gets a gradient
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (33, 17, 64)]
    res = _fb(rt, u, data)
    ref, _ = peft_reference(qwen3_dir, rt, u)
    total = 0.0
    for d, out in zip(data, res.outputs):
        logits = ref(torch.from_numpy(d.tokens)[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(d.loss_inputs["target_tokens"])[:, None])[:, 0]
        np.testing.assert_allclose(out["logprobs"], lp.detach().numpy(), rtol=1e-5, atol=1e-5)
        loss = -(lp * torch.from_numpy(d.loss_inputs["weights"])).sum()
        loss.backward()
        total += float(loss.detach())
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    ours, theirs = _grads(rt, u), peft_grads(ref)
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        rel = float((g - theirs[name]).norm() / theirs[name].norm())
        assert rel < 1e-4, name


def test_two_adapters_in_one_batch_equal_separate_batches(rt):
    rng = np.random.default_rng(2)
    a = rt.create_adapter(LoraSpec(rank=8, seed=1))
    b = rt.create_adapter(LoraSpec(rank=4, seed=2, train_mlp=False))
    _perturb_B(rt, a, 1)
    _perturb_B(rt, b, 2)
    da = [sft_datum(rng, n, VOCAB) for n in (20, 31)]
    db = [sft_datum(rng, n, VOCAB) for n in (25, 12, 31)]
    mixed = rt.forward_backward([TrainRequest(a, ForwardBackwardInput(da, "cross_entropy")),
                                 TrainRequest(b, ForwardBackwardInput(db, "cross_entropy"))])
    ga, gb = _grads(rt, a), _grads(rt, b)
    for u in (a, b):
        rt.unit(u).optimizer.zero_grad(set_to_none=True)
    sa, sb = _fb(rt, a, da), _fb(rt, b, db)
    for mixed_res, single in ((mixed[0], sa), (mixed[1], sb)):
        for x, y in zip(mixed_res.outputs, single.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
        assert mixed_res.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"], rel=1e-5)
    for g_mixed, u in ((ga, a), (gb, b)):
        for n, g in _grads(rt, u).items():
            assert_rel_close(g_mixed[n], g, 1e-5, n)


def test_gradient_accumulation_equals_one_combined_call(rt):
    rng = np.random.default_rng(3)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    _perturb_B(rt, u, 3)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (10, 20, 30, 40)]
    _fb(rt, u, data[:1])
    _fb(rt, u, data[1:3])
    _fb(rt, u, data[3:])
    accumulated = _grads(rt, u)
    rt.unit(u).optimizer.zero_grad(set_to_none=True)
    _fb(rt, u, data)
    for n, g in _grads(rt, u).items():
        assert_rel_close(accumulated[n], g, 1e-5, n)


def test_forward_only_keeps_no_graph_and_no_grads(rt):
    rng = np.random.default_rng(4)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    res = _fb(rt, u, [sft_datum(rng, 16, VOCAB)], forward_only=True)
    assert not rt.has_pending_grads(u)
    assert res.outputs[0]["logprobs"].shape == (16,)
    assert res.metrics["loss:sum"] > 0


def test_two_dimensional_targets(rt, qwen3_dir):
    rng = np.random.default_rng(5)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    n, k = 12, 3
    toks = rng.integers(0, VOCAB, n)
    tgt = rng.integers(0, VOCAB, (n, k))
    w = rng.random((n, k)).astype(np.float32)
    res = _fb(rt, u, [Datum(toks, {"target_tokens": tgt, "weights": w})])
    lp = res.outputs[0]["logprobs"]
    assert lp.shape == (n, k) and res.outputs[0]["elementwise_loss"].shape == (n, k)
    one_d = _fb(rt, u, [Datum(toks, {"target_tokens": tgt[:, 1]})], forward_only=True)
    np.testing.assert_allclose(lp[:, 1], one_d.outputs[0]["logprobs"], rtol=1e-5, atol=1e-6)
    assert res.metrics["loss:sum"] == pytest.approx(float(-(lp * w).sum()), rel=1e-5)


def test_micro_batching_and_checkpointing_equal_plain_path(qwen3_dir):
    rng = np.random.default_rng(6)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (5, 50, 17, 33, 8, 64, 21)]
    results = []
    for kwargs in ({}, {"micro_batch_tokens": 64}, {"micro_batch_seqs": 2}, {"gradient_checkpointing": True},
                   {"micro_batch_tokens": 100, "gradient_checkpointing": True}):
        rt = TrainingRuntime(load_model(str(qwen3_dir)).model, **kwargs)
        u = rt.create_adapter(LoraSpec(rank=4, seed=9))
        _perturb_B(rt, u, 9)
        res = _fb(rt, u, data)
        results.append((res, _grads(rt, u)))
    (ref, ref_g), rest = results[0], results[1:]
    for res, g in rest:
        assert res.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(res.outputs, ref.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
        for n in ref_g:
            assert_rel_close(g[n], ref_g[n], 1e-5, n)


def test_chunked_logprobs_equal_unchunked(rt):
    rng = np.random.default_rng(7)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    _perturb_B(rt, u, 5)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (40, 30)]
    plain = _fb(rt, u, data)
    g_plain = _grads(rt, u)
    rt.unit(u).optimizer.zero_grad(set_to_none=True)
    rt.logit_chunk_bytes = VOCAB * 4 * 7  # 7 tokens per chunk
    chunked = _fb(rt, u, data)
    for x, y in zip(plain.outputs, chunked.outputs):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-6, atol=1e-6)
    for n, g in _grads(rt, u).items():
        assert_rel_close(g, g_plain[n], 1e-5, n)


def test_adamw_step_matches_reference_formula(rt):
    rng = np.random.default_rng(8)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    _perturb_B(rt, u, 8)
    hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5)
    before = {n: p.detach().clone() for n, p in rt.unit(u).named_params}
    _fb(rt, u, [sft_datum(rng, 30, VOCAB)])
    grads = _grads(rt, u)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    assert norm > hp.grad_clip_norm  # clipping is exercised
    metrics = rt.optim_step(u, hp)
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    scale = hp.grad_clip_norm / (float(norm) + 1e-6)
    for n, p in rt.unit(u).named_params:
        g = grads[n] * scale
        m = (1 - hp.beta1) * g
        v = (1 - hp.beta2) * g * g
        m_hat, v_hat = m / (1 - hp.beta1), v / (1 - hp.beta2)
        expected = before[n] * (1 - hp.learning_rate * hp.weight_decay) - hp.learning_rate * m_hat / (v_hat.sqrt() + hp.eps)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
    assert not rt.has_pending_grads(u)


def test_one_adapters_step_leaves_others_bit_identical(rt):
    rng = np.random.default_rng(9)
    a = rt.create_adapter(LoraSpec(rank=8, seed=1))
    b = rt.create_adapter(LoraSpec(rank=4, seed=2))
    _perturb_B(rt, b, 4)
    data = [sft_datum(rng, 20, VOCAB)]
    rt.forward_backward([TrainRequest(a, ForwardBackwardInput(data, "cross_entropy")),
                         TrainRequest(b, ForwardBackwardInput(data, "cross_entropy"))])
    b_weights = {n: p.detach().clone() for n, p in rt.unit(b).named_params}
    b_grads = _grads(rt, b)
    b_opt = copy.deepcopy(rt.unit(b).optimizer.state_dict())
    for _ in range(3):
        rt.optim_step(a, AdamParams(learning_rate=0.1, weight_decay=0.5))
        _fb(rt, a, data)
    for n, p in rt.unit(b).named_params:
        assert torch.equal(p.detach(), b_weights[n]), n
        assert torch.equal(p.grad, b_grads[n]), n
    assert rt.unit(b).optimizer.state_dict()["state"] == b_opt["state"]
    # Optimizer state is sized to each adapter's own rank.
    rt.optim_step(b, AdamParams())
    for (n, p) in rt.unit(b).named_params:
        state = rt.unit(b).optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and (4 in p.shape), n


def test_full_finetune_grads_match_transformers(qwen3_dir):
    import transformers

    rt = TrainingRuntime(load_model(str(qwen3_dir)).model, full_finetune=True)
    rng = np.random.default_rng(10)
    data = [sft_datum(rng, 25, VOCAB, signed=True), sft_datum(rng, 9, VOCAB, signed=True)]
    res = _fb(rt, 0, data)
    ref = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    total = 0.0
    for d in data:
        lp = torch.log_softmax(ref(torch.from_numpy(d.tokens)[None]).logits[0], -1)
        lp = lp.gather(-1, torch.from_numpy(d.loss_inputs["target_tokens"])[:, None])[:, 0]
        loss = -(lp * torch.from_numpy(d.loss_inputs["weights"])).sum()
        loss.backward()
        total += float(loss.detach())
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    theirs = dict(ref.named_parameters())
    for n, p in rt.unit(0).named_params:
        assert_rel_close(p.grad, theirs[n].grad, 1e-4, n)
    before = rt.unit(0).params[3].detach().clone()
    rt.optim_step(0, AdamParams(learning_rate=1e-3))
    assert not torch.equal(before, rt.unit(0).params[3])
    with pytest.raises(InvalidInputError, match="full fine-tune"):
        rt.create_adapter(LoraSpec(rank=4))


def test_sft_loss_falls(rt):
    rng = np.random.default_rng(11)
    u = rt.create_adapter(LoraSpec(rank=8, seed=1))
    data = [sft_datum(rng, 32, VOCAB) for _ in range(4)]
    losses = []
    for _ in range(15):
        losses.append(_fb(rt, u, data).metrics["loss:sum"])
        rt.optim_step(u, AdamParams(learning_rate=5e-3))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.__setattr__("tokens", np.array([1, 2, 9999])), "token ids outside"),
        (lambda d: d.loss_inputs.__setitem__("target_tokens", np.array([1, 2])), "has 2 rows but model_input has 3"),
        (lambda d: d.loss_inputs.__setitem__("weights", np.array([1.0, np.nan, 1.0], np.float32)), "NaN"),
        (lambda d: d.loss_inputs.__setitem__("target_tokens", np.array([1, 2, -1])), "target_tokens"),
        (lambda d: d.loss_inputs.__setitem__("weights", np.ones(4, np.float32)), "weights"),
        (lambda d: d.__setattr__("tokens", np.array([], dtype=np.int64)), "at least one token"),
    ],
)
def test_bad_input_is_rejected_before_anything_changes(rt, mutate, match):
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    v = rt.create_adapter(LoraSpec(rank=4, seed=2))
    good = Datum(np.array([1, 2, 3]), {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})
    bad = copy.deepcopy(good)
    mutate(bad)
    res = rt.forward_backward([TrainRequest(u, ForwardBackwardInput([good, bad], "cross_entropy")),
                               TrainRequest(v, ForwardBackwardInput([good], "cross_entropy"))])
    assert isinstance(res[0], InvalidInputError) and match in str(res[0])
    assert not rt.has_pending_grads(u)  # nothing half-applied
    assert rt.has_pending_grads(v) and res[1].metrics["loss:sum"] > 0  # the other tenant ran


def test_inputs_the_loss_does_not_read_are_ignored(rt):
    """Recipes pass RL fields along to cross_entropy; the hosted service ignores them, so do we."""
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    good = Datum(np.array([1, 2, 3]), {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})
    extra = copy.deepcopy(good)
    extra.loss_inputs["advantages"] = np.array([np.nan, 1.0], np.float32)  # wrong length, even NaN: unread
    extra.loss_inputs["mask"] = np.ones(3, np.float32)
    want, got = rt.forward_backward([TrainRequest(u, ForwardBackwardInput([good], "cross_entropy", forward_only=True)),
                                     TrainRequest(u, ForwardBackwardInput([extra], "cross_entropy", forward_only=True))])
    assert not isinstance(got, Exception), got
    assert got.metrics["loss:sum"] == want.metrics["loss:sum"]


def test_unknown_loss_and_capacity_errors(rt):
    u = rt.create_adapter(LoraSpec(rank=4))
    d = Datum(np.array([1, 2]), {"target_tokens": np.array([2, 3])})
    (res,) = rt.forward_backward([TrainRequest(u, ForwardBackwardInput([d], "nonsense"))])
    assert isinstance(res, InvalidInputError) and "nonsense" in str(res)
    (res,) = rt.forward_backward([TrainRequest(u, ForwardBackwardInput([d], "importance_sampling"))])
    assert isinstance(res, InvalidInputError) and "advantages" in str(res)
    with pytest.raises(CapacityError, match="rank=17"):
        rt.create_adapter(LoraSpec(rank=17))
    rt.max_training_runs = 4
    for _ in range(3):
        rt.create_adapter(LoraSpec(rank=2))
    with pytest.raises(CapacityError, match="max-training-runs"):
        rt.create_adapter(LoraSpec(rank=2))
    with pytest.raises(InvalidInputError, match="learning_rate"):
        rt.optim_step(u, AdamParams(learning_rate=float("nan")))


def test_more_runs_than_slots_park_idle_adapters_exactly(qwen3_dir):
    """Five runs on three resident slots train exactly like five runs with room for all."""
    rng = np.random.default_rng(12)
    datas = [[sft_datum(rng, n, VOCAB, signed=True) for n in (12, 20)] for _ in range(5)]
    tight = TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=3)
    roomy = TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=8)
    ut = [tight.create_adapter(LoraSpec(rank=4, seed=i)) for i in range(5)]
    ur = [roomy.create_adapter(LoraSpec(rank=4, seed=i)) for i in range(5)]
    assert len(tight.lru) == 3 and sum(not tight.unit(u).resident for u in ut) == 2
    for step in range(2):
        # All five in one call: split into waves of at most three attached adapters.
        reqs_t = [TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in zip(ut, datas)]
        reqs_r = [TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in zip(ur, datas)]
        for a, b in zip(tight.forward_backward(reqs_t), roomy.forward_backward(reqs_r)):
            assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
        for i in (4, 0, 2, 1, 3):  # steps in an order that forces parking and unparking
            tight.optim_step(ut[i], AdamParams(learning_rate=1e-2))
            roomy.optim_step(ur[i], AdamParams(learning_rate=1e-2))
    for a, b in zip(ut, ur):
        for (n, x), (_, y) in zip(tight.unit(a).named_params, roomy.unit(b).named_params):
            assert_rel_close(x.detach(), y.detach(), 1e-5, n)
    assert len(tight.lru) <= 3


def test_a_pass_run_in_small_chunks_equals_one_call(rt):
    """The engine runs big requests a chunk at a time between other tenants' work: same numbers."""
    rng = np.random.default_rng(21)
    data_a = [sft_datum(rng, int(n), VOCAB) for n in rng.integers(8, 60, 7)]
    data_b = [sft_datum(rng, int(n), VOCAB) for n in rng.integers(8, 60, 5)]
    results = {}
    for how in ("whole", "chunked"):
        a, b = rt.create_adapter(LoraSpec(rank=4, seed=1)), rt.create_adapter(LoraSpec(rank=8, seed=2))
        _perturb_B(rt, a, 5)
        _perturb_B(rt, b, 6)
        reqs_a = [TrainRequest(a, ForwardBackwardInput(data_a, "cross_entropy")),
                  TrainRequest(a, ForwardBackwardInput(data_a[:2], "cross_entropy", forward_only=True))]
        reqs_b = [TrainRequest(b, ForwardBackwardInput(data_b, "cross_entropy"))]
        if how == "whole":
            res = rt.forward_backward(reqs_a + reqs_b)
        else:
            pa, pb = rt.begin(reqs_a), rt.begin(reqs_b)
            calls = 0
            while not (pa.done and pb.done):
                rt.advance([(pa, 30), (pb, 1)])  # pb's datums never fit: it runs once pa is done
                calls += 1
            assert calls >= 7
            res = pa.results + pb.results
        results[how] = (res, _grads(rt, a), _grads(rt, b))
        rt.delete_adapter(a)
        rt.delete_adapter(b)
    (whole, ga, gb), (chunked, ca, cb) = results["whole"], results["chunked"]
    for x, y in zip(whole, chunked):
        assert x.metrics["loss:sum"] == pytest.approx(y.metrics["loss:sum"], rel=1e-6)
        for ox, oy in zip(x.outputs, y.outputs):
            np.testing.assert_allclose(ox["logprobs"], oy["logprobs"], rtol=1e-5, atol=1e-6)
    for g, h in ((ga, ca), (gb, cb)):
        for n in g:
            torch.testing.assert_close(g[n], h[n], rtol=1e-3, atol=1e-5)  # other micro-batch shapes, other rounding


def test_a_pass_that_fails_midway_leaves_its_gradients_as_before(rt, monkeypatch):
    rng = np.random.default_rng(22)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    _fb(rt, u, [sft_datum(rng, 16, VOCAB)])  # some gradient already accumulated
    before = _grads(rt, u)
    p = rt.begin([TrainRequest(u, ForwardBackwardInput([sft_datum(rng, 16, VOCAB) for _ in range(4)], "cross_entropy"))])
    rt.advance([(p, 16)])  # the first datum ran: gradients moved
    assert not all(torch.equal(before[n], g) for n, g in _grads(rt, u).items())
    monkeypatch.setattr(rt, "_run_micro_batch", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    rt.advance([(p, 16)])
    assert p.done and isinstance(p.results[0], RuntimeError)
    for n, g in _grads(rt, u).items():
        assert torch.equal(before[n], g), n


def test_an_accumulating_pass_copies_no_gradient(rt):
    """A second forward/backward before the optimizer step adds to the gradients so far. The
    earlier ones are taken off the parameters for the pass (in case it fails), not copied: one
    copy per LoRA tensor and pass is a kernel launch each on a GPU, hundreds per tenant."""
    rng = np.random.default_rng(23)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    first, second = [sft_datum(rng, 16, VOCAB)], [sft_datum(rng, 16, VOCAB)]
    _fb(rt, u, first)
    params = len(rt.unit(u).params)
    clones = dispatched(lambda: _fb(rt, u, second))["aten.clone.default"]
    assert clones < params // 2, (clones, params)
    accumulated = _grads(rt, u)
    rt.unit(u).restore_grads([None] * params)
    _fb(rt, u, first + second)
    for n, g in _grads(rt, u).items():
        torch.testing.assert_close(accumulated[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_an_optimizer_step_takes_every_gradient_norm_at_once(rt):
    """The global gradient norm (reported, and used to clip) comes from one multi-tensor norm,
    not a cast and a norm kernel per LoRA tensor, and equals the norm of all the gradients."""
    rng = np.random.default_rng(24)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    _fb(rt, u, [sft_datum(rng, 16, VOCAB)])
    grads = [p.grad.clone() for p in rt.unit(u).params]
    out = {}
    ops = dispatched(lambda: out.update(rt.optim_step(u, AdamParams(learning_rate=1e-3))))
    assert ops["aten._foreach_norm.Scalar"] == 1 and ops["aten.linalg_vector_norm.default"] == 0, ops
    expected = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
    assert abs(out["grad_norm"] - expected) <= 1e-5 * expected, (out, expected)
