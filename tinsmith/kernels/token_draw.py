"""The decode step's token choice in two kernels: each row's draw and its logprob, its logits read about once.

In torch, choosing a token for every row of a decode step over a 151,936-entry vocabulary is
about 35 kernels and more than ten full passes over the rows' logits, several of them in fp32 or
fp64 (a copy to fp32, the log-softmax, the argmax, the tempered softmax's max, shift, scale and
exponent, a float64 copy, block sums and the scans of the inverse CDF, the gathers). At decode
sizes those passes and launches are a measurable part of a step that should be bound by reading
the weights. Here the logits are read in the dtype they come in, in two launches:

- **segments**: each row's vocabulary is cut into segments of whole blocks, one program per row
  and segment (a 64-row step over Qwen3's vocabulary: 2,432 programs). Each computes its
  segment's largest logit and where it first is, the sum of ``exp(l - max)`` at temperature 1
  (the returned logprobs are the model's own) and at the row's temperature (the draw's weights);
- **pick**: one program per row combines its segments' figures in vocabulary order (the first
  largest logit: greedy rows and temperature 0; the normalisers), finds the segment where the
  cumulative tempered weight, in float64, reaches ``u`` times the total, and reads that segment
  alone again for the token: the first whose cumulative weight reaches it, as
  :func:`tinsmith.sampling.logits._inverse_cdf` finds it (up to the rounding of sums taken in
  another order; the segment's last entry with weight where rounding leaves the draw past it).

One program per row walking the whole vocabulary twice (the scheme before, ``MAX_SEGMENTS`` 1)
took 154 us at 64 rows on an H200 where reading the logits twice takes 9: a row's blocks were a
chain of dependent reductions on one SM while most of the GPU idled. The sums are taken in a
fixed order whatever the scheduling (no atomics), so a graph-replayed step equals the eager one
and seeded draws repeat.

Rows that truncate (top-k / top-p) and steps that return top-k logprobs keep the torch path
(:mod:`tinsmith.sampling.logits`), which is also the CPU's and the reference in tests.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import pdl
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernels for CUDA logits, torch for the rest; "torch"; "triton": the kernels for any
# logits (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("token-choice kernel", "choosing tokens in torch")
BLOCK = 4096  # vocabulary entries a program reads at once
# At most this many segments a row (each of whole blocks): Qwen3's vocabulary is 38 blocks, one
# segment each. 1 is one program a row over the whole vocabulary (benchmarks compare the two).
MAX_SEGMENTS = 64


def usable(logits: torch.Tensor) -> bool:
    """Whether :func:`draw` takes the kernels for ``logits`` (rows, vocabulary)."""
    if triton is None or not GUARD.allows(BACKEND, logits):
        return False
    return logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[0] > 0 and logits.dtype.is_floating_point


def segments(vocab: int, block: int) -> tuple[int, int]:
    """(segments a row, blocks a segment) for a vocabulary read ``block`` entries at a time: as
    many segments as :data:`MAX_SEGMENTS` allows, none empty. Shapes only (graph capture)."""
    blocks = triton.cdiv(vocab, block)
    per = triton.cdiv(blocks, max(1, MAX_SEGMENTS))
    return triton.cdiv(blocks, per), per


def draw(logits: torch.Tensor, temperature: torch.Tensor, u, all_greedy: bool = False,
         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens, their model logprobs) for rows of ``logits``: row ``i`` greedy where
    ``temperature[i]`` <= 0, else drawn from ``softmax(logits[i] / temperature[i])`` with the
    uniform ``u[i]`` (float64) by inverse CDF in vocabulary order; logprobs at temperature 1, in
    fp32. ``u`` may be a :class:`tinsmith.sampling.logits.KeyedUniforms` (``keys``, ``steps``):
    the kernel then hashes each row's uniform itself, as ``keyed_uniforms`` does, bit for bit.
    ``all_greedy``: every row is greedy (no tempered sums, no second read). None when the kernels
    failed here (the caller takes the torch path). ``out``: (tokens, logprobs) buffers, (rows,)
    int64 and fp32, contiguous, that the kernel writes (a decode step's own, so that no copy
    follows)."""
    rows = logits.shape[0]
    if out is not None:
        tokens, logprobs = out
        assert (tokens.shape == logprobs.shape == (rows,) and tokens.dtype == torch.long
                and logprobs.dtype == torch.float32 and tokens.is_contiguous() and logprobs.is_contiguous())
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    done = GUARD.call(_launch, logits, temperature, u, tokens, logprobs, all_greedy, on=logits)
    return None if done is None else (tokens, logprobs)


def _launch(logits, temperature, u, tokens, logprobs, all_greedy: bool):
    keyed = not isinstance(u, torch.Tensor)  # KeyedUniforms (not imported: logits imports this module)
    draws = (u.keys.contiguous(), u.steps.contiguous()) if keyed else (u.contiguous(),) * 2
    rows, vocab = logits.shape
    block = min(BLOCK, triton.next_power_of_2(vocab))
    count, per = segments(vocab, block)
    # Each segment's largest logit, the sums of exp(l - largest) at temperature 1 and at the
    # row's, and where its largest logit first is.
    stats = torch.empty(3, rows, count, dtype=torch.float32, device=logits.device)
    best = torch.empty(rows, count, dtype=torch.int64, device=logits.device)
    warps = 8 if block >= 2048 else 4
    _segments_kernel[(rows, count)](logits, temperature, stats, best, vocab, logits.stride(0), stats.stride(0),
                                    COUNT=count, PER=per, BLOCK=block, SAMPLE=not all_greedy, num_warps=warps,
                                    **pdl.options(logits))
    _pick_kernel[(rows,)](logits, temperature, *draws, stats, best, tokens, logprobs, vocab, logits.stride(0),
                          stats.stride(0), COUNT=count, COUNT_P2=triton.next_power_of_2(count), PER=per,
                          BLOCK=block, SAMPLE=not all_greedy, KEYED=keyed, num_warps=warps, **pdl.options(logits))
    return tokens


if triton is not None:

    @triton.jit
    def _keyed_uniform(x):
        """``keyed_uniforms``' float64 U(0, 1) of an int64 ``keys + step``: splitmix64 in wrapping
        unsigned arithmetic (the torch version's signed constants and masked shifts are the same
        bits), then the top 53 bits plus a half, over 2**53."""
        z = x.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        return ((z >> 11).to(tl.float64) + 0.5) / 9007199254740992.0

    @triton.jit
    def _segments_kernel(logits_ptr, temp_ptr, stats_ptr, best_ptr, vocab, stride_row, stride_stat,
                         COUNT: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                         PDL: tl.constexpr = False):
        """One row and segment: the online maximum, its first place and the two sums. Sums are
        taken relative to a finite shift (the maximum so far, 0 while that is -inf), so a segment
        or a start of one of -inf only keeps sums of 0 and a maximum of -inf, never NaN."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        base = logits_ptr + row * stride_row
        t = tl.load(temp_ptr + row).to(tl.float32)
        scale = tl.where(t > 0, t, 1.0)  # greedy rows' tempered sums are unused
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)  # sum of exp(l - m)
        tempered = tl.zeros([], tl.float32)  # sum of exp((l - m) / scale)
        best = tl.zeros([], tl.int64)
        first = seg * (PER * BLOCK)
        for b in range(PER):
            start = first + b * BLOCK
            at = start + cols
            lg = tl.load(base + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
            top = tl.max(lg, axis=0)
            where = tl.argmax(lg, axis=0, tie_break_left=True)
            best = tl.where(top > m, start + where.to(tl.int64), best)  # strictly: the first largest stays
            new_m = tl.maximum(m, top)
            shift = tl.where(new_m > float("-inf"), new_m, 0.0)
            total = total * tl.exp(m - shift) + tl.sum(tl.exp(lg - shift), axis=0)
            if SAMPLE:
                tempered = tempered * tl.exp((m - shift) / scale) + tl.sum(tl.exp((lg - shift) / scale), axis=0)
            m = new_m
        out = stats_ptr + row * COUNT + seg
        tl.store(out, m)
        tl.store(out + stride_stat, total)
        tl.store(out + 2 * stride_stat, tempered)
        tl.store(best_ptr + row * COUNT + seg, best)

    @triton.jit
    def _pick_kernel(logits_ptr, temp_ptr, u_ptr, step_ptr, stats_ptr, best_ptr, tok_ptr, lp_ptr, vocab, stride_row,
                     stride_stat, COUNT: tl.constexpr, COUNT_P2: tl.constexpr, PER: tl.constexpr,
                     BLOCK: tl.constexpr, SAMPLE: tl.constexpr, KEYED: tl.constexpr, PDL: tl.constexpr = False):
        """One row: its segments combined in vocabulary order, then the inverse-CDF draw within the
        segment where the cumulative weight reaches the target (that segment read again). With
        ``KEYED``, ``u_ptr`` holds the rows' keys and ``step_ptr`` their steps, and the uniform is
        their hash (:func:`_keyed_uniform`)."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        segs = tl.arange(0, COUNT_P2)
        live = segs < COUNT
        at_seg = stats_ptr + row * COUNT + segs
        ms = tl.load(at_seg, mask=live, other=float("-inf"))
        m = tl.max(ms, axis=0)
        shift = tl.where(m > float("-inf"), m, 0.0)
        some = ms > float("-inf")  # segments with a finite logit (the others' sums are 0)
        totals = tl.load(at_seg + stride_stat, mask=live, other=0.0)
        total = tl.sum(tl.where(some, totals * tl.exp(ms - shift), 0.0), axis=0)
        first_top = tl.min(tl.where(live & (ms == m), segs, COUNT_P2), axis=0)
        token = tl.load(best_ptr + row * COUNT + tl.minimum(first_top, COUNT - 1))
        if SAMPLE:
            t = tl.load(temp_ptr + row).to(tl.float32)
            scale = tl.where(t > 0, t, 1.0)
            tempered = tl.load(at_seg + 2 * stride_stat, mask=live, other=0.0)
            weights = tl.where(some, tempered * tl.exp((ms - shift) / scale), 0.0).to(tl.float64)
            if KEYED:
                u = _keyed_uniform(tl.load(u_ptr + row).to(tl.int64) + tl.load(step_ptr + row).to(tl.int64))
            else:
                u = tl.load(u_ptr + row).to(tl.float64)
            target = u * tl.sum(weights, axis=0)
            reach = tl.cumsum(weights, axis=0)
            seg = tl.min(tl.where(live & (reach >= target), segs, COUNT_P2), axis=0)
            last_seg = tl.max(tl.where(live & (weights > 0), segs, 0), axis=0)
            seg = tl.where(seg < COUNT_P2, seg, last_seg)  # rounding left the target past the end
            before = tl.sum(tl.where(segs < seg, weights, 0.0), axis=0)
            cols = tl.arange(0, BLOCK)
            found = tl.full([], -1, tl.int64)
            last = tl.full([], -1, tl.int64)  # the segment's last entry with weight
            first = seg.to(tl.int64) * (PER * BLOCK)
            for b in range(PER):
                at = first + b * BLOCK + cols
                valid = at < vocab
                lg = tl.load(base + at, mask=valid, other=float("-inf")).to(tl.float32)
                w = tl.exp((lg - shift) / scale)
                reach_in = before + tl.cumsum(w, axis=0).to(tl.float64)
                hit = valid & (reach_in >= target) & (found < 0)
                hit_at = tl.min(tl.where(hit, at, vocab), axis=0).to(tl.int64)
                found = tl.where(hit_at < vocab, hit_at, found)
                last = tl.maximum(last, tl.max(tl.where(valid & (w > 0), at, -1), axis=0).to(tl.int64))
                before += tl.sum(w, axis=0).to(tl.float64)
            drawn = tl.where(found >= 0, found, tl.where(last >= 0, last, token))
            token = tl.where(t > 0, drawn, token)
        chosen = tl.load(base + token).to(tl.float32)
        tl.store(tok_ptr + row, token)
        tl.store(lp_ptr + row, chosen - m - tl.log(total))


__all__ = ["BACKEND", "MAX_SEGMENTS", "draw", "segments", "usable"]
