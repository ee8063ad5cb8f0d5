"""Dimuon: the optimizer's math, and a Dimuon adapter inside the training runtime."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tinsmith.errors import InvalidInputError
from tinsmith.models.loading import load_model
from tinsmith.optim import normalize_optimizer_config
from tinsmith.optim.dimuon import Dimuon, matrix_direction, newton_schulz, precondition, rank_lr_factor
from tinsmith.types import AdamParams, DimuonParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tests.worker.helpers import dispatched, sft_datum

VOCAB = 512


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ the math
@pytest.mark.parametrize("shape", [(4, 64), (64, 4), (8, 32)])
def test_newton_schulz_makes_every_singular_value_near_one(shape):
    """LoRA-shaped factors (rank x in, out x rank): Muon's quintic leaves singular values in
    about [0.7, 1.2] whatever their spread was (here a factor 10 across columns)."""
    x = torch.randn(shape, generator=_gen(0)) * torch.logspace(-0.5, 0.5, shape[1])
    s = torch.linalg.svdvals(newton_schulz(x))
    assert float(torch.linalg.svdvals(x).max() / torch.linalg.svdvals(x).min()) > 1.9
    assert s.min() > 0.65 and s.max() < 1.2, s
    # Same singular vectors as the exact polar factor U V^T.
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    cos = (newton_schulz(x) * (u @ vh)).sum() / (torch.linalg.matrix_norm(u @ vh) * torch.linalg.matrix_norm(newton_schulz(x)))
    assert cos > 0.97


@pytest.mark.parametrize("shape,rank", [((8, 48), 8), ((48, 8), 8), ((3, 10), 3)])
def test_direction_has_frobenius_norm_sqrt_rank(shape, rank):
    d = matrix_direction(torch.randn(shape, generator=_gen(1)), damping=1.0, norm=math.sqrt(rank))
    assert float(torch.linalg.matrix_norm(d)) == pytest.approx(math.sqrt(rank), rel=1e-5)


def test_zero_momentum_gives_no_update():
    assert torch.count_nonzero(matrix_direction(torch.zeros(4, 9), 1.0, 2.0)) == 0


def test_damping_interpolates_between_equalised_rows_and_plain_muon():
    m = torch.randn(6, 40, generator=_gen(2))
    m[0] *= 30.0  # one loud row
    loud_share = lambda x: float(x[0].square().sum() / x.square().sum())  # noqa: E731
    heavy = precondition(m, damping=1e6)
    light = precondition(m, damping=1e-6)
    # Huge damping: a uniform scaling, the row keeps its share (plain Muon's input).
    assert loud_share(heavy) == pytest.approx(loud_share(m), rel=1e-4)
    # Tiny damping: the loud row is divided by its own RMS and no longer dominates.
    assert loud_share(light) < 0.1 < 0.9 < loud_share(m)
    # In between, the loud row's share grows with damping, monotonically.
    shares = [loud_share(precondition(m, d)) for d in (1e-6, 1e-3, 1e-1, 1.0, 10.0, 1e3, 1e6)]
    assert shares == sorted(shares)
    assert 0.1 < shares[3] < loud_share(m) - 0.03  # the default damping (1.0) still tempers it


def test_rank_lr_correction_relative_to_32():
    assert rank_lr_factor(32, 0.5) == 1.0
    assert rank_lr_factor(8, 0.5) == pytest.approx(0.5)
    assert rank_lr_factor(128, 1.0) == pytest.approx(4.0)
    assert rank_lr_factor(8, 0.0) == 1.0  # zero disables it
    assert rank_lr_factor(None, 0.5) == 1.0  # full fine-tune: no LoRA rank


def test_default_rank_correction_makes_the_weight_change_rank_independent():
    """docs/optimizers.md's reason for e = 0.5: with LoRA's alpha / rank scaling, a first step on
    B changes W = W0 + (32 / r) B A by the same Frobenius norm at every rank."""
    sizes = {}
    for r in (4, 16, 64):
        g = _gen(r)
        a = (torch.rand(r, 256, generator=g) * 2 - 1) / 16  # kaiming-uniform A, in = 256
        d = matrix_direction(torch.randn(256, r, generator=g), damping=1.0, norm=math.sqrt(r))
        for e in (0.0, 0.5):
            sizes[r, e] = float(torch.linalg.matrix_norm((32 / r) * rank_lr_factor(r, e) * d @ a))
    assert sizes[4, 0.0] > 3 * sizes[64, 0.0]  # uncorrected: falls as 1 / sqrt(rank)
    assert max(sizes[r, 0.5] for r in (4, 16, 64)) < 1.05 * min(sizes[r, 0.5] for r in (4, 16, 64))


def test_step_follows_the_formula_with_momentum_and_rank_correction():
    rank, lr, beta1, damping, e = 4, 0.1, 0.8, 0.5, 0.5
    w = torch.randn(rank, 24, generator=_gen(3))
    p = w.clone().requires_grad_()
    opt = Dimuon([p], rank=rank)
    for g in opt.param_groups:
        g.update(lr=lr, beta1=beta1, damping=damping, rank_lr_correction_exponent=e)
    g1, g2 = torch.randn(rank, 24, generator=_gen(4)), torch.randn(rank, 24, generator=_gen(5))
    expected, m = w.clone(), torch.zeros_like(w)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
        m = beta1 * m + (1 - beta1) * g
        expected -= lr * (rank / 32) ** e * matrix_direction(m, damping, math.sqrt(rank))
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["momentum"], m)


def test_vectors_take_an_rms_one_momentum_step():
    p = torch.zeros(10, requires_grad=True)
    opt = Dimuon([p], lr=0.01)
    p.grad = torch.arange(1.0, 11.0)
    opt.step()
    assert float(p.detach().square().mean().sqrt()) == pytest.approx(0.01, rel=1e-5)


def test_dimuon_params_and_config_validation():
    DimuonParams(learning_rate=0.0).validate()
    DimuonParams(learning_rate=1e-3, grad_clip_norm=-1.0).validate()  # non-positive: no clipping
    for field, value in (("learning_rate", -1e-3), ("beta1", 1.0), ("damping", 0.0),
                         ("rank_lr_correction_exponent", float("inf"))):
        with pytest.raises(InvalidInputError, match=f"optimizer_params.{field}="):
            DimuonParams(**{"learning_rate": 1e-3, field: value}).validate()
    assert normalize_optimizer_config(None) == {"type": "adamw"}
    assert normalize_optimizer_config({"type": "adam"}) == {"type": "adamw"}
    assert normalize_optimizer_config({"type": "dimuon"}) == {"type": "dimuon", "version": 1}
    assert normalize_optimizer_config({"type": "AdamW"}) == {"type": "adamw"}
    with pytest.raises(InvalidInputError, match=r"optimizer_config.type 'sgd'.*adamw, dimuon"):
        normalize_optimizer_config({"type": "sgd"})
    with pytest.raises(InvalidInputError, match="optimizer_config.version"):
        normalize_optimizer_config({"type": "dimuon", "version": 2})


# ------------------------------------------------------------------------------------ the runtime
@pytest.fixture()
def rt(qwen3_dir):
    return TrainingRuntime(load_model(str(qwen3_dir)).model, max_lora_adapters=4, max_lora_rank=16)


def _fb(rt, unit, data):
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))])
    if isinstance(res, Exception):
        raise res
    return res


def _loss(res) -> float:
    return float(sum(-(o["logprobs"]).sum() for o in res.outputs))


def test_dimuon_adapter_learns_and_rejects_adam_params(rt):
    rng = np.random.default_rng(0)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1), "dimuon")
    pattern = rng.integers(0, VOCAB, 6)
    tokens = np.tile(pattern, 6)
    from tinsmith.types import Datum

    data = [Datum(tokens=tokens[:-1], loss_inputs={"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})]
    losses = []
    for _ in range(6):
        losses.append(_loss(_fb(rt, u, data)))
        rt.optim_step(u, DimuonParams(learning_rate=0.05))
    assert losses[-1] < 0.7 * losses[0], losses
    _fb(rt, u, data)
    with pytest.raises(InvalidInputError, match="adam_params"):
        rt.optim_step(u, AdamParams())
    assert rt.has_pending_grads(u)  # the refused step left the gradients alone
    # Each matrix's step was a sqrt(rank)-norm direction: momentum is kept per tensor.
    tr = rt.unit(u)
    assert all(set(tr.optimizer.state[p]) == {"momentum"} for p in tr.params)


def test_dimuon_state_round_trips_bit_identically(rt):
    rng = np.random.default_rng(1)
    batches = [[sft_datum(rng, 16, VOCAB)] for _ in range(4)]
    hp = DimuonParams(learning_rate=0.02, beta1=0.85, grad_clip_norm=1.0, damping=0.3, rank_lr_correction_exponent=1.0)
    a = rt.create_adapter(LoraSpec(rank=4, seed=2), "dimuon")
    for data in batches[:2]:
        _fb(rt, a, data)
        rt.optim_step(a, hp)
    weights, opt = rt.unit(a).export_state()
    assert any(k.endswith(".momentum") for k in opt) and not any(k.endswith(".exp_avg") for k in opt)
    b = rt.create_adapter(LoraSpec(rank=4, seed=99), "dimuon")
    rt.unit(b).import_state(copy.deepcopy(weights), copy.deepcopy(opt))
    for data in batches[2:]:
        for unit in (a, b):
            _fb(rt, unit, data)
            rt.optim_step(unit, hp)
    for (n, pa), (_, pb) in zip(rt.unit(a).named_params, rt.unit(b).named_params):
        assert torch.equal(pa.detach(), pb.detach()), n


def test_dimuon_step_leaves_an_adamw_neighbour_bit_identical(rt):
    rng = np.random.default_rng(2)
    data = [sft_datum(rng, 20, VOCAB)]
    d = rt.create_adapter(LoraSpec(rank=8, seed=1), "dimuon")
    a = rt.create_adapter(LoraSpec(rank=4, seed=2))
    rt.forward_backward([TrainRequest(d, ForwardBackwardInput(data, "cross_entropy")),
                         TrainRequest(a, ForwardBackwardInput(data, "cross_entropy"))])
    rt.optim_step(a, AdamParams(learning_rate=1e-2))
    _fb(rt, a, data)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in rt.unit(a).named_params}
    opt_before = copy.deepcopy(rt.unit(a).optimizer.state_dict()["state"])
    for _ in range(3):
        rt.optim_step(d, DimuonParams(learning_rate=0.1))
        _fb(rt, d, data)
    for n, p in rt.unit(a).named_params:
        assert torch.equal(p.detach(), before[n][0]) and torch.equal(p.grad, before[n][1]), n
    after = rt.unit(a).optimizer.state_dict()["state"]
    assert all(torch.equal(after[i][k], opt_before[i][k]) for i in opt_before for k in opt_before[i])


def test_full_finetune_with_dimuon(qwen3_dir):
    """Matrices step by lr * sqrt(min(m, n)) in Frobenius norm (no LoRA rank, no correction),
    vectors (norm weights) by lr in RMS; the loss falls."""
    rt = TrainingRuntime(load_model(str(qwen3_dir)).model, full_finetune=True, full_optimizer="dimuon")
    tr = rt.unit(0)
    rng = np.random.default_rng(3)
    data = [sft_datum(rng, 24, VOCAB)]
    lr = 1e-3
    first = _loss(_fb(rt, 0, data))
    before = {n: p.detach().clone() for n, p in tr.named_params}
    had_grad = {n for n, p in tr.named_params if p.grad is not None and bool(p.grad.any())}
    rt.optim_step(0, DimuonParams(learning_rate=lr, rank_lr_correction_exponent=3.0))  # ignored: no LoRA rank
    kinds = set()
    for n, p in tr.named_params:
        if n not in had_grad:
            continue
        delta = (p.detach() - before[n]).double()
        if p.ndim == 2:
            expected = lr * math.sqrt(min(p.shape))
            assert float(torch.linalg.matrix_norm(delta)) == pytest.approx(expected, rel=1e-3), n
        else:
            assert float(delta.square().mean().sqrt()) == pytest.approx(lr, rel=1e-3), n
        kinds.add(p.ndim)
    assert kinds == {1, 2}
    for _ in range(3):
        _fb(rt, 0, data)
        rt.optim_step(0, DimuonParams(learning_rate=lr))
    assert _loss(_fb(rt, 0, data)) < first


@pytest.mark.parametrize("shape", [(3, 4, 24), (3, 24, 4)], ids=["A", "B"])
def test_stacked_expert_matrices_each_get_their_own_direction(shape):
    """Routed experts' LoRA tensors are stacks of matrices: each expert's update is that expert's
    own orthogonalised direction, with norm sqrt(rank), as if it were a separate parameter (an
    expert whose momentum is zero stays put). The stack runs in batched matmuls, and the step
    reads nothing back from the device (it used to read one norm per expert)."""
    torch.manual_seed(0)
    rank = 4
    grads = torch.randn(shape)
    grads[1] = 0.0  # an expert no token reached
    stacked = torch.zeros(shape, requires_grad=True)
    singles = [torch.zeros(shape[1:], requires_grad=True) for _ in range(shape[0])]
    opt_stacked = Dimuon([stacked], lr=1.0, rank=rank, rank_lr_correction_exponent=0.0)
    opt_singles = Dimuon(singles, lr=1.0, rank=rank, rank_lr_correction_exponent=0.0)
    stacked.grad = grads.clone()
    for p, g in zip(singles, grads):
        p.grad = g.clone()
    reads = dispatched(opt_stacked.step)["aten._local_scalar_dense.default"]  # float(t), t.item(), bool(t)
    assert reads == 0, reads
    opt_singles.step()
    assert not stacked.detach()[1].any()
    for e, p in enumerate(singles):
        torch.testing.assert_close(stacked.detach()[e], p.detach())
        if e != 1:
            assert abs(float(torch.linalg.matrix_norm(p.detach())) - rank ** 0.5) < 1e-4
