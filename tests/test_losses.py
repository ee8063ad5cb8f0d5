"""Every loss against a direct numpy computation of its value and its gradient w.r.t. logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinsmith.errors import InvalidInputError
from tinsmith.losses import LossBatch, resolve_loss

E = 50


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lp = -rng.random(E) * 3
    q = lp + rng.normal(scale=0.4, size=E)  # ratios spread on both sides of the clip bounds
    return lp, {"logprobs": q, "advantages": rng.normal(size=E), "weights": rng.normal(size=E)}


def _run(name, lp, inputs, **config):
    spec, cfg = resolve_loss(name, config)
    t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    batch = LossBatch(t, {k: torch.tensor(v) for k, v in inputs.items()}, [0, min(20, len(lp)), len(lp)], cfg)
    out = spec.fn(batch)
    out.loss.backward()
    return out, t.grad.numpy()


def _np_cases(lp, x, lo=None, hi=None, beta=None):
    r = np.exp(lp - x["logprobs"])
    A = x["advantages"]
    yield "cross_entropy", {}, -lp * x["weights"], -x["weights"]
    yield "importance_sampling", {}, -r * A, -r * A
    lo_p, hi_p = 0.8, 1.2
    clipped = np.clip(r, lo_p, hi_p)
    el = -np.minimum(r * A, clipped * A)
    use_unclipped = (r * A <= clipped * A) | ((r >= lo_p) & (r <= hi_p))
    yield "ppo", {}, el, np.where(use_unclipped, -r * A, 0.0)
    c = np.clip(r, 0.0, 4.0)
    yield "cispo", {}, -c * A * lp, -c * A
    b = 0.3
    d = lp - x["logprobs"]
    yield "dro", {"beta": b}, -(lp * A - 0.5 * b * d * d), -(A - b * d)


@pytest.mark.parametrize("case", range(5))
def test_loss_value_and_gradient_match_numpy(case):
    lp, x = _inputs()
    name, cfg, el, grad = list(_np_cases(lp, x))[case]
    needed = {"cross_entropy": ["weights"]}.get(name, ["logprobs", "advantages"])
    out, g = _run(name, lp, {k: x[k] for k in needed}, **cfg)
    np.testing.assert_allclose(out.elementwise.detach().numpy(), el, rtol=1e-10)
    np.testing.assert_allclose(float(out.loss), el.sum(), rtol=1e-10)
    np.testing.assert_allclose(g, grad, rtol=1e-10, atol=1e-12)
    assert out.metrics["loss:sum"] == pytest.approx(el.sum())
    assert all(k.count(":") == 1 for k in out.metrics)


def test_ppo_thresholds_come_from_config():
    lp, x = _inputs(1)
    a, _ = _run("ppo", lp, {k: x[k] for k in ("logprobs", "advantages")})
    b, _ = _run("ppo", lp, {k: x[k] for k in ("logprobs", "advantages")}, clip_low_threshold=0.5, clip_high_threshold=2.0)
    assert float(a.loss) != float(b.loss)
    assert 0 <= a.metrics["clip_fraction:mean"] <= 1


def test_unknown_loss_and_config_are_rejected():
    with pytest.raises(InvalidInputError, match="'bogus'"):
        resolve_loss("bogus", {})
    with pytest.raises(InvalidInputError, match="clip_low"):
        resolve_loss("cross_entropy", {"clip_low_threshold": 0.1})
    with pytest.raises(InvalidInputError, match="beta"):
        resolve_loss("dro", {"beta": "high"})


def test_gspo_matches_numpy():
    lp, x = _inputs(2)
    rng = np.random.default_rng(3)
    mask = (rng.random(E) > 0.3).astype(float)
    offsets = [0, 20, E]
    lo, hi = 0.9, 1.1
    spec, cfg = resolve_loss("gspo", {"clip_low_threshold": lo, "clip_high_threshold": hi})
    t = torch.tensor(lp, requires_grad=True)
    inputs = {"logprobs": torch.tensor(x["logprobs"]), "advantages": torch.tensor(x["advantages"]),
              "sequence_ratio_mask": torch.tensor(mask)}
    out = spec.fn(LossBatch(t, inputs, offsets, cfg))
    out.loss.backward()
    exp_el, exp_grad = np.zeros(E), np.zeros(E)
    for a, b in zip(offsets, offsets[1:]):
        m, d, A = mask[a:b], (lp - x["logprobs"])[a:b], x["advantages"][a:b]
        n = max(m.sum(), 1.0)
        s = np.exp((m * d).sum() / n)
        unclipped, clipped = s * A, np.clip(s, lo, hi) * A
        exp_el[a:b] = -m * np.minimum(unclipped, clipped) / n
        # d s / d lp_t = s * m_t / n; the unclipped branch (or an unclamped s) carries the gradient.
        live = (unclipped <= clipped) | ((s >= lo) & (s <= hi))
        coef = np.where(live, -m * A / n, 0.0)  # d el_k / d s for each k
        exp_grad[a:b] = coef.sum() * s * m / n
    np.testing.assert_allclose(out.elementwise.detach().numpy(), exp_el, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(t.grad.numpy(), exp_grad, rtol=1e-8, atol=1e-12)


def test_stable_reinforce_matches_numpy():
    lp, x = _inputs(4)
    out, g = _run("stable_reinforce", lp, {k: x[k] for k in ("logprobs", "advantages")})
    r = np.exp(lp - x["logprobs"])
    w = np.clip(r, 0.0, 2.0)
    np.testing.assert_allclose(out.elementwise.detach().numpy(), -w * x["advantages"] * lp, rtol=1e-10)
    np.testing.assert_allclose(g, -w * x["advantages"], rtol=1e-10)
    assert 0 <= out.metrics["truncated_fraction:mean"] <= 1


def test_dro_leaves_unsampled_positions_unpenalised():
    """RL datums mark prompt positions with logprob 0 and advantage 0: no pull on them."""
    lp = np.array([-2.0, -1.5, -0.7, -0.3])
    inputs = {"logprobs": np.array([0.0, 0.0, -0.9, -0.2]), "advantages": np.array([0.0, 0.0, 1.0, -1.0])}
    out, g = _run("dro", lp, inputs, beta=0.5)
    np.testing.assert_allclose(g[:2], [0.0, 0.0])
    d = lp[2:] - inputs["logprobs"][2:]
    np.testing.assert_allclose(g[2:], -(inputs["advantages"][2:] - 0.5 * d))


def test_ratio_metric_ignores_unsampled_positions():
    lp = np.array([-3.0, -2.0, -0.5, -0.5])
    inputs = {"logprobs": np.array([0.0, 0.0, -0.5, -0.5]), "advantages": np.array([0.0, 0.0, 1.0, 1.0])}
    out, _ = _run("importance_sampling", lp, inputs)
    assert out.metrics["ratio:mean"] == pytest.approx(1.0)
