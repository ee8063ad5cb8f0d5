"""The blocked inverse-CDF draw (GPUs, large vocabularies) picks what one running sum over the row picks."""

from __future__ import annotations

import pytest
import torch

from tinsmith.sampling import logits as logits_mod
from tinsmith.sampling.logits import (CDF_BLOCK, RowKinds, _inverse_cdf_blocked, _inverse_cdf_flat, choose_tokens,
                                      choose_tokens_masked, uniforms)


def _weights(rows: int, vocab: int, kind: str, g: torch.Generator) -> torch.Tensor:
    w = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3, -1)
    if kind == "sparse":  # top-k / top-p style: most entries zero, whole blocks of them
        keep = torch.rand(rows, vocab, generator=g) < 0.001
        keep[:, vocab - 1] = True  # weight in the last, padded block
        w = torch.where(keep, w, torch.zeros_like(w))
    elif kind == "peaked":  # one token holds almost all the mass
        w[:, vocab // 2] += 1e4
    return w


@pytest.mark.parametrize("vocab", [4 * CDF_BLOCK + 1, 5000, 151_936, 201_088])
@pytest.mark.parametrize("kind", ["dense", "sparse", "peaked"])
def test_blocked_draws_equal_flat_draws(vocab, kind):
    g = torch.Generator().manual_seed(vocab)
    w = _weights(8, vocab, kind, g)
    for u in (torch.rand(8, generator=g, dtype=torch.float64), torch.rand(8, 4, generator=g, dtype=torch.float64),
              torch.tensor([0.0, 1.0, 0.5, 1e-300, 1 - 1e-16, 0.25, 0.75, 0.999], dtype=torch.float64)):
        got, want = _inverse_cdf_blocked(w, u), _inverse_cdf_flat(w, u)
        assert torch.equal(got, want)
        picked = w.gather(-1, got if got.dim() == 2 else got[:, None])
        drawn = (u if u.dim() == 2 else u[:, None]) > 0  # u = 0 may land on a leading zero, as before
        assert bool((picked[drawn] > 0).all())


def test_a_block_that_ends_short_of_the_draw_stays_on_a_weighted_entry():
    """A draw at the very top of the row lands on its last weighted entry, never on padding."""
    vocab = 4 * CDF_BLOCK + 10
    w = torch.zeros(1, vocab, dtype=torch.float64)
    w[0, [3, CDF_BLOCK + 7, 4 * CDF_BLOCK + 2]] = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    got = _inverse_cdf_blocked(w, torch.tensor([1.0], dtype=torch.float64))
    assert got.tolist() == [4 * CDF_BLOCK + 2]


def test_the_sampler_tail_picks_the_same_tokens_blocked_or_not(monkeypatch):
    """choose_tokens and the static step's choose_tokens_masked over a real vocabulary size."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 6, 151_936
    logits = torch.randn(rows, vocab, generator=g) * 4
    t = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 1.0])
    k = torch.tensor([0, 0, 50, 0, 0, 0])
    p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5])
    u = uniforms(torch.full((rows,), 7), torch.arange(rows), torch.full((rows,), 2))
    kinds = RowKinds.of(t.tolist(), k.tolist(), p.tolist(), vocab, logits.device)
    truncates = torch.zeros(rows, dtype=torch.bool)
    truncates[kinds.truncating] = True
    picks = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(logits_mod, "BLOCKED_CDF", mode)
        picks[mode] = (choose_tokens(logits, t, k, p, u, kinds)[0].tolist(),
                       choose_tokens_masked(logits, t, k, p, u, truncates, all_greedy=False)[0].tolist())
    assert picks["always"] == picks["never"]
    assert picks["never"][0] == picks["never"][1]
