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
    batch = LossBatch(t, {k: torch.tensor(v) for k, v in inputs.items()}, [0, 20, E], cfg)
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
