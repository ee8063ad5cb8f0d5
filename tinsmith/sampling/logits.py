"""Choosing the next token for every row of a decode batch at once.

Randomness is counter-based: a row's uniform draw at step ``t`` is a hash of
``(seed, sample index, t)``, so a seeded request samples the same tokens whatever else shares
its batch, and no per-row generator objects or per-token Python calls are needed. The token is
picked by inverse-CDF over the temperature-scaled, top-k / top-p truncated distribution.
Returned logprobs are the model's own (temperature 1, untruncated): what a forward pass on the
same tokens gives, which is what RL importance ratios need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinsmith.kernels import token_draw
from tinsmith.transfers import to_device

_MASK64 = (1 << 64) - 1


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 64-bit hash of int64 tensors (wrapping arithmetic).

    The constants are Python scalars, not tensors: a tensor made from a Python value on a GPU
    is a host-to-device copy, which a CUDA graph capture cannot record.
    """
    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ _srl(x, 30)) * -4658895280553007687
    x = (x ^ _srl(x, 27)) * -7723592293110705685
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


@dataclass(frozen=True)
class KeyedUniforms:
    """A step's uniforms not made yet: ``keyed_uniforms(keys, steps)``. The token-choice kernel
    hashes them itself (one launch where torch takes 18 small ones); the torch path makes them."""

    keys: torch.Tensor
    steps: torch.Tensor

    def made(self) -> torch.Tensor:
        return keyed_uniforms(self.keys, self.steps)


def _made(u: torch.Tensor | KeyedUniforms) -> torch.Tensor:
    return u.made() if isinstance(u, KeyedUniforms) else u


def fold_seed(seed: int) -> int:
    """Any Python int (the SDK allows 64-bit and beyond) folded into int64."""
    s = seed & _MASK64
    return s - (1 << 64) if s >= (1 << 63) else s


@dataclass(frozen=True)
class RowKinds:
    """Which rows of a batch are greedy and which truncate (top-k / top-p), known on the host.

    The sampler builds it from the requests' parameters once per set of rows, so a decode
    step never asks the device (a host sync that stalls the launch queue) which branch to take.
    Index tensors, not boolean masks: indexing with a mask needs its count, another sync.
    """

    all_greedy: bool
    any_greedy: bool
    truncating: torch.Tensor | None  # indices of rows that truncate; None: none do
    plain: torch.Tensor | None  # indices of the other rows; None: none (all truncate)

    @classmethod
    def of(cls, temperature: list[float], top_k: list[int], top_p: list[float], vocab: int,
           device: torch.device) -> RowKinds:
        trunc = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if 0 < k < vocab or p < 1]
        truncated = set(trunc)
        plain = [i for i in range(len(temperature)) if i not in truncated]
        greedy = [t <= 0 for t in temperature]
        as_index = (lambda ix: to_device(ix, device, torch.long) if ix else None)
        return cls(all(greedy), any(greedy), as_index(trunc), as_index(plain))


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor | KeyedUniforms,
    kinds: RowKinds | None = None,
    need_full: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pick one token per row. Returns (tokens, their model logprobs, full model logprobs).

    ``temperature`` 0 means greedy; ``top_k`` <= 0 means no limit; ``top_p`` in (0, 1].
    Logprobs are computed in fp32 whatever the logits' dtype. ``kinds`` (from the same
    parameters) avoids reading them back from the device; without it they are read back.
    Without ``need_full`` the full logprobs may be None: where no row truncates, a GPU then
    chooses in one kernel (:mod:`tinsmith.kernels.token_draw`) without making them.
    """
    if not need_full and kinds is not None and kinds.truncating is None and token_draw.usable(logits):
        chosen = token_draw.draw(logits, temperature, u, kinds.all_greedy)
        if chosen is not None:
            return (*chosen, None)
    u = _made(u)
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    V = logits.shape[-1]
    if kinds is None:
        kinds = RowKinds.of(temperature.tolist(), top_k.tolist(), top_p.tolist(), V, logits.device)
    if kinds.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), logprobs
    greedy = temperature <= 0
    probs = _tempered_probs(logits, torch.where(greedy, torch.ones_like(temperature), temperature)[:, None])
    # Rows that truncate (top-k / top-p) need their distribution sorted; the others draw by
    # inverse CDF in vocabulary order, which skips the sort. Either way a row's token depends
    # only on its own logits and its own uniform, never on the rest of the batch.
    if kinds.truncating is None:  # the common case: no masking or scattering of rows
        sampled = _inverse_cdf(probs.double(), u)
    else:
        sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if kinds.plain is not None:
            plain = kinds.plain
            sampled.index_copy_(0, plain, _inverse_cdf(probs.index_select(0, plain).double(), u.index_select(0, plain)))
        rows = kinds.truncating
        sampled.index_copy_(0, rows, _truncated_draw(probs.index_select(0, rows), top_k.index_select(0, rows),
                                                     top_p.index_select(0, rows), u.index_select(0, rows)))
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled) if kinds.any_greedy else sampled
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), logprobs


def choose_tokens_masked(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor | KeyedUniforms,
    truncates: torch.Tensor | None,
    all_greedy: bool,
    top: int = 0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.return_types.topk | None]:
    """:func:`choose_tokens` with shapes that never depend on which rows do what (CUDA graphs).

    Where :func:`choose_tokens` picks rows by index, this computes every row both ways and keeps
    each row's own result by mask (``truncates``: bool per row, None when no row truncates), so
    a row gets exactly the token :func:`choose_tokens` gives it. ``all_greedy`` must hold for
    every row when set. Returns (tokens, their model logprobs, every row's ``top`` largest model
    logprobs, None when ``top`` is 0). Where no row truncates and ``top`` is 0, a GPU chooses in
    one kernel (:mod:`tinsmith.kernels.token_draw`). ``out``: (tokens, logprobs) buffers (int64,
    fp32) that receive the results, written by that kernel itself where it runs, and returned.
    """
    if truncates is None and not top and token_draw.usable(logits):
        chosen = token_draw.draw(logits, temperature, u, all_greedy, out=out)
        if chosen is not None:
            return (*chosen, None)
    tokens, chosen_lp, best = _choose_masked(logits, temperature, top_k, top_p, u, truncates, all_greedy, top)
    if out is None:
        return tokens, chosen_lp, best
    out[0].copy_(tokens)
    out[1].copy_(chosen_lp)
    return out[0], out[1], best


def _choose_masked(logits, temperature, top_k, top_p, u, truncates, all_greedy: bool, top: int):
    """:func:`choose_tokens_masked` in torch ops."""
    u = _made(u)
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    argmax = logits.argmax(dim=-1)
    if all_greedy:
        tokens = argmax
    else:
        greedy = temperature <= 0
        probs = _tempered_probs(logits, torch.where(greedy, torch.ones_like(temperature), temperature)[:, None])
        sampled = _inverse_cdf(probs.double(), u)
        if truncates is not None:
            sampled = torch.where(truncates, _truncated_draw(probs, top_k, top_p, u), sampled)
        tokens = torch.where(greedy, argmax, sampled)
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1) if top else None
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), best


def _truncated_draw(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``probs`` cut to its ``top_k`` largest and its ``top_p`` mass (sorted order)."""
    V = probs.shape[-1]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(V, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
    keep = (rank < k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p)).double()
    return order.gather(-1, _inverse_cdf(kept, u)[:, None]).squeeze(-1)


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


# Vocabularies above FLAT_CDF_MAX entries are searched in blocks of CDF_BLOCK (see _inverse_cdf):
# BLOCKED_CDF "auto" on CUDA devices only, "always", or "never".
CDF_BLOCK = 1024
FLAT_CDF_MAX = 4 * CDF_BLOCK
BLOCKED_CDF = "auto"


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from unnormalised non-negative ``weights`` (rows) with uniforms ``u``.

    ``u`` is (rows,) for one draw per row, or (rows, k) for k draws from each row's one CDF.

    On a GPU a large vocabulary is searched in blocks (:func:`_inverse_cdf_blocked`): a scan
    along a 150k-entry row is a long serial loop there (a few rows per thread block). On a CPU
    one running sum is cheapest, and it stays the reference.
    """
    blocked = BLOCKED_CDF == "always" or (BLOCKED_CDF == "auto" and weights.is_cuda)
    if weights.shape[-1] <= FLAT_CDF_MAX or not blocked:
        return _inverse_cdf_flat(weights, u)
    return _inverse_cdf_blocked(weights, u)


def _inverse_cdf_blocked(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`_inverse_cdf` in two levels, which picks the same index as one running sum over the
    row (up to the rounding of float64 sums in another order): the blocks' sums, their running
    total, the block the draw falls in, then a running sum inside that block only."""
    V = weights.shape[-1]
    one = u.dim() == 1
    uk = u[:, None] if one else u  # (rows, k)
    rows, k = uk.shape
    nb = -(-V // CDF_BLOCK)
    blocks = torch.nn.functional.pad(weights, (0, nb * CDF_BLOCK - V)).view(rows, nb, CDF_BLOCK)
    block_cdf = blocks.sum(-1).cumsum(-1)  # (rows, nb)
    target = uk * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, target).clamp_(max=nb - 1)  # (rows, k)
    before = block_cdf.gather(-1, (b - 1).clamp(min=0)) * (b > 0)
    chosen = blocks.gather(1, b[:, :, None].expand(rows, k, CDF_BLOCK))  # (rows, k, CDF_BLOCK)
    j = torch.searchsorted(chosen.cumsum(-1), (target - before)[:, :, None]).squeeze(-1)
    # The block's running sum may end a rounding error short of the draw: stay on its last
    # entry that has weight (never a zero-weight one, nor the padding).
    last = CDF_BLOCK - 1 - (chosen > 0).flip(-1).to(torch.int8).argmax(-1)
    idx = b * CDF_BLOCK + torch.minimum(j, last)
    return idx[:, 0] if one else idx


def _inverse_cdf_flat(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`_inverse_cdf` with one running sum over the whole row (small vocabularies)."""
    cdf = torch.cumsum(weights, dim=-1)
    one = u.dim() == 1
    target = (u[:, None] if one else u) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target)
    return (idx[:, 0] if one else idx).clamp_(max=weights.shape[-1] - 1)
