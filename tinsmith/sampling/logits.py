"""Choosing the next token for every row of a decode batch at once.

Randomness is counter-based: a row's uniform draw at step ``t`` is a hash of
``(seed, sample index, t)``, so a seeded request samples the same tokens whatever else shares
its batch, and no per-row generator objects or per-token Python calls are needed. The token is
picked by inverse-CDF over the temperature-scaled, top-k / top-p truncated distribution.
Returned logprobs are the model's own (temperature 1, untruncated): what a forward pass on the
same tokens gives, which is what RL importance ratios need.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 64-bit hash of int64 tensors (wrapping arithmetic)."""
    x = x + torch.tensor(-7046029254386353131, dtype=torch.int64, device=x.device)  # 0x9E3779B97F4A7C15
    x = (x ^ _srl(x, 30)) * torch.tensor(-4658895280553007687, dtype=torch.int64, device=x.device)
    x = (x ^ _srl(x, 27)) * torch.tensor(-7723592293110705685, dtype=torch.int64, device=x.device)
    return x ^ _srl(x, 31)


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift on int64."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniforms(seeds: torch.Tensor, sample_idx: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """U(0,1) per row from (seed, sample index, step); float64 for resolution over big vocabs."""
    return keyed_uniforms(row_keys(seeds, sample_idx), step)


def row_keys(seeds: torch.Tensor, sample_idx: torch.Tensor) -> torch.Tensor:
    """The per-row half of :func:`uniforms`, computed once while a row lives in the batch."""
    return splitmix64(seeds ^ splitmix64(sample_idx))


def keyed_uniforms(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """U(0,1) per row from its :func:`row_keys` value and the step."""
    h = splitmix64(keys + step)
    return (_srl(h, 11).double() + 0.5) / float(1 << 53)


def fold_seed(seed: int) -> int:
    """Any Python int (the SDK allows 64-bit and beyond) folded into int64."""
    s = seed & _MASK64
    return s - (1 << 64) if s >= (1 << 63) else s


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row. Returns (tokens, their model logprobs, full model logprobs).

    ``temperature`` 0 means greedy; ``top_k`` <= 0 means no limit; ``top_p`` in (0, 1].
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = temperature <= 0
    V = logits.shape[-1]
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), logprobs
    probs = _tempered_probs(logits, torch.where(greedy, torch.ones_like(temperature), temperature)[:, None])
    # Rows that truncate (top-k / top-p) need their distribution sorted; the others draw by
    # inverse CDF in vocabulary order, which skips the sort. Either way a row's token depends
    # only on its own logits and its own uniform, never on the rest of the batch.
    truncating = ((top_k > 0) & (top_k < V)) | (top_p < 1)
    plain = ~truncating
    if bool(plain.all()):  # the common case: no masking or scattering of rows
        sampled = _inverse_cdf(probs.double(), u)
    else:
        sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if bool(plain.any()):
            sampled[plain] = _inverse_cdf(probs[plain].double(), u[plain])
        rows = truncating.nonzero().squeeze(-1)
        sorted_p, order = torch.sort(probs[rows], dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None, :]
        k = torch.where(top_k[rows] > 0, top_k[rows], torch.full_like(top_k[rows], V))
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
        keep = (rank < k[:, None]) & ((before < top_p[rows][:, None]) | (rank == 0))
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p)).double()
        sampled[rows] = order.gather(-1, _inverse_cdf(kept, u[rows])[:, None]).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled) if bool(greedy.any()) else sampled
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), logprobs


def draw_per_row(logprobs: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """``u.shape[1]`` independent draws from each row's distribution at ``temperature``.

    ``logprobs`` (rows, V) are the model's; ``u`` (rows, k) uniforms. Temperature 0 gives the
    argmax every time. One CDF per row, searched k times: no copy of the rows per draw.
    """
    if temperature <= 0:
        return logprobs.argmax(dim=-1, keepdim=True).expand(-1, u.shape[1])
    return _inverse_cdf(_tempered_probs(logprobs, temperature).double(), u.to(logprobs.device))


def _tempered_probs(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """softmax(logits / temperature) per row; ``temperature`` > 0, a float or a (rows, 1) tensor.

    Shifted so the largest logit is 0 before dividing: a tiny positive temperature (down to
    float32 denormals) then sends the others to -inf instead of overflowing to inf - inf = NaN.
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(shifted / temperature, dim=-1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from unnormalised non-negative ``weights`` (rows) with uniforms ``u``.

    ``u`` is (rows,) for one draw per row, or (rows, k) for k draws from each row's one CDF.
    """
    cdf = torch.cumsum(weights, dim=-1)
    one = u.dim() == 1
    target = (u[:, None] if one else u) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target)
    return (idx[:, 0] if one else idx).clamp_(max=weights.shape[-1] - 1)
