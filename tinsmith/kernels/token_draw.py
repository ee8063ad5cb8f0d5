"""The decode step's token choice as one kernel: each row's draw and its logprob in two reads of its logits.

In torch, choosing a token for every row of a decode step over a 151,936-entry vocabulary is
about 35 kernels and more than ten full passes over the rows' logits, several of them in fp32 or
fp64 (a copy to fp32, the log-softmax, the argmax, the tempered softmax's max, shift, scale and
exponent, a float64 copy, block sums and the scans of the inverse CDF, the gathers). At decode
sizes those passes and launches are a measurable part of a step that should be bound by reading
the weights. Here one program per row reads its logits twice, in the dtype they come in:

- first, an online log-sum-exp at temperature 1 (the returned logprobs are the model's own), the
  same at the row's temperature (the draw's normaliser), and the first largest logit (greedy
  rows, and temperature 0);
- then, only where a row samples, the tempered weights again, block by block, with a float64
  running total: the token is the first whose cumulative weight reaches ``u`` times the total,
  as :func:`tinsmith.sampling.logits._inverse_cdf` finds it (up to the rounding of sums taken in
  another order; the last entry with weight where rounding leaves the draw past the end).

Rows that truncate (top-k / top-p) and steps that return top-k logprobs keep the torch path
(:mod:`tinsmith.sampling.logits`), which is also the CPU's and the reference in tests.
"""

from __future__ import annotations

import torch

from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA logits, torch for the rest; "torch"; "triton": the kernel for any
# logits (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("token-choice kernel", "choosing tokens in torch")
BLOCK = 4096  # vocabulary entries a program reads at once


def usable(logits: torch.Tensor) -> bool:
    """Whether :func:`draw` takes the kernel for ``logits`` (rows, vocabulary)."""
    if triton is None or not GUARD.allows(BACKEND, logits):
        return False
    return logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[0] > 0 and logits.dtype.is_floating_point


def draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
         all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens, their model logprobs) for rows of ``logits``: row ``i`` greedy where
    ``temperature[i]`` <= 0, else drawn from ``softmax(logits[i] / temperature[i])`` with the
    uniform ``u[i]`` (float64) by inverse CDF in vocabulary order; logprobs at temperature 1, in
    fp32. ``all_greedy``: every row is greedy (no second read). None when the kernel failed here
    (the caller takes the torch path)."""
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    done = GUARD.call(_launch, logits, temperature, u, tokens, logprobs, all_greedy, on=logits)
    return None if done is None else (tokens, logprobs)


def _launch(logits, temperature, u, tokens, logprobs, all_greedy: bool):
    rows, vocab = logits.shape
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _draw_kernel[(rows,)](logits, temperature, u, tokens, logprobs, vocab, logits.stride(0),
                          BLOCK=block, SAMPLE=not all_greedy, num_warps=8 if block >= 2048 else 4)
    return tokens


if triton is not None:

    @triton.jit
    def _draw_kernel(logits_ptr, temp_ptr, u_ptr, tok_ptr, lp_ptr, vocab, stride_row,
                     BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
        """One row: the online maxima and sums (read one), then the inverse-CDF draw (read two)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        t = tl.load(temp_ptr + row).to(tl.float32)
        scale = tl.where(t > 0, t, 1.0)  # greedy rows' tempered sums are unused
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)  # sum of exp(l - m)
        tempered = tl.zeros([], tl.float32)  # sum of exp((l - m) / t)
        best = tl.zeros([], tl.int64)
        for start in range(0, vocab, BLOCK):
            at = start + cols
            lg = tl.load(base + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
            top = tl.max(lg, axis=0)
            where = tl.argmax(lg, axis=0, tie_break_left=True)
            best = tl.where(top > m, start + where.to(tl.int64), best)  # strictly: the first largest stays
            new_m = tl.maximum(m, top)
            total = total * tl.exp(m - new_m) + tl.sum(tl.exp(lg - new_m), axis=0)
            tempered = tempered * tl.exp((m - new_m) / scale) + tl.sum(tl.exp((lg - new_m) / scale), axis=0)
            m = new_m
        token = best
        if SAMPLE:
            target = tl.load(u_ptr + row).to(tl.float64) * tempered.to(tl.float64)
            before = tl.zeros([], tl.float64)
            found = tl.full([], -1, tl.int64)
            last = tl.zeros([], tl.int64)  # the last entry with weight: where rounding leaves the draw past the end
            for start in range(0, vocab, BLOCK):
                at = start + cols
                live = at < vocab
                lg = tl.load(base + at, mask=live, other=float("-inf")).to(tl.float32)
                w = tl.exp((lg - m) / scale)
                reach = before + tl.cumsum(w, axis=0).to(tl.float64)
                hit = live & (reach >= target) & (found < 0)
                first = tl.min(tl.where(hit, at, vocab), axis=0).to(tl.int64)
                found = tl.where(first < vocab, first, found)
                last = tl.maximum(last, tl.max(tl.where(live & (w > 0), at, -1), axis=0).to(tl.int64))
                before += tl.sum(w, axis=0).to(tl.float64)
            drawn = tl.where(found >= 0, found, last)
            token = tl.where(t > 0, drawn, best)
        chosen = tl.load(base + token).to(tl.float32)
        tl.store(tok_ptr + row, token)
        tl.store(lp_ptr + row, chosen - m - tl.log(total))


__all__ = ["BACKEND", "draw", "usable"]
