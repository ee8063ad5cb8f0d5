"""Exact log-probabilities of chosen tokens from a vocabulary-parallel LM head, chunk by chunk.

Each rank holds a block of vocabulary rows, so each computes its block of a chunk's logits. The
log-softmax needs the whole row: the ranks all-reduce the row maximum, then (in one collective)
the sum of ``exp(logit - max)`` and the chosen token's logit, which only its owning rank
contributes (the others add zero). ``logsumexp = max + log(sum)`` is then the same number on
every rank. As in :mod:`tinsmith.models.chunked_logprobs`, rows go a chunk at a time and
backward recomputes each chunk's logits, so full logits never exist, here not even one rank's
share of them for all rows.

Backward: ``d logits = onehot(g) - softmax * sum(g)`` restricted to this rank's columns gives
this rank's shard gradients (weight, bias, LoRA ``B``) and a partial hidden-state gradient; the
caller's :func:`copy_to_tp` on the hidden states sums those over ranks; the replicated LoRA
``A`` keeps its partial gradient until the step sums it (:func:`sum_replicated_grads`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from tinsmith.models.chunked_logprobs import UnembedLora, _chunk_logits, _element_bounds, rows_per_chunk
from tinsmith.parallel.comm import all_reduce_, copy_to_tp
from tinsmith.parallel.group import TPGroup


def vocab_parallel_target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    tp: TPGroup,
    vocab_start: int,
    *,
    bias: torch.Tensor | None = None,
    loras: list[UnembedLora] | tuple[UnembedLora, ...] = (),
    chunk_rows: int | None = None,
    rows_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_softmax(full logits)[rows[e], cols[e]]`` (fp32) where this rank holds vocabulary rows
    ``[vocab_start, vocab_start + len(weight))`` of the head and of each adapter's ``B``.

    Same arguments and differentiability as
    :func:`tinsmith.models.chunked_logprobs.chunked_target_logprobs`; ``cols`` are full-vocabulary
    ids. Every rank must call it with the same hidden states, rows and columns.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    chunk = chunk_rows or rows_per_chunk(weight.shape[0])
    spans = tuple((w.start, w.end, w.scale) for w in loras)
    factors = [t for w in loras for t in (w.A, w.B)]
    bounds = tuple(_element_bounds(rows if rows_host is None else rows_host, hidden.shape[0], chunk))
    hidden = copy_to_tp(hidden, tp)
    return _VocabParallelLogprobs.apply(hidden, weight, bias, rows, cols, chunk, bounds, spans, tp, vocab_start,
                                        *factors)


def _row_stats(logits: torch.Tensor, local_rows: torch.Tensor, local_cols: torch.Tensor, tp: TPGroup
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row logsumexp over the whole vocabulary, and each element's full-vocabulary logit."""
    m = all_reduce_(logits.max(dim=-1).values, tp, dist.ReduceOp.MAX, "logit max all_reduce")
    sums = (logits - m[:, None]).exp().sum(-1)
    v = logits.shape[1]
    own = (local_cols >= 0) & (local_cols < v)
    picked = torch.where(own, logits[local_rows, local_cols.clamp(0, v - 1)], 0.0)
    both = all_reduce_(torch.cat((sums, picked)), tp, what="sum-exp all_reduce")
    return m + both[: len(m)].log(), both[len(m):]


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, cols, chunk, bounds, spans, tp, vocab_start, *factors):
        n = hidden.shape[0]
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for c, a in enumerate(range(0, n, chunk)):
            b = min(n, a + chunk)
            ea, eb = bounds[c], bounds[c + 1]
            logits = _chunk_logits(hidden[a:b], weight, bias, a, spans, factors)
            chunk_lse, picked = _row_stats(logits, rows[ea:eb] - a, cols[ea:eb] - vocab_start, tp)
            lse[a:b] = chunk_lse
            out[ea:eb] = picked - chunk_lse[rows[ea:eb] - a]
        ctx.save_for_backward(hidden, weight, bias, rows, cols, lse, *factors)
        ctx.chunk, ctx.bounds, ctx.spans, ctx.vocab_start = chunk, bounds, spans, vocab_start
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, rows, cols, lse, *factors = ctx.saved_tensors
        chunk, bounds, spans, v0 = ctx.chunk, ctx.bounds, ctx.spans, ctx.vocab_start
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_f = ctx.needs_input_grad[10:]
        n, dtype, v = hidden.shape[0], hidden.dtype, weight.shape[0]
        grad_out = grad_out.float()
        g_row = torch.zeros(n, dtype=torch.float32, device=hidden.device).index_add_(0, rows, grad_out)
        d_h = torch.empty_like(hidden) if need_h else None
        d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        d_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        d_f = [torch.zeros(f.shape, dtype=torch.float32, device=f.device) if need else None
               for f, need in zip(factors, need_f)]
        for c, a in enumerate(range(0, n, chunk)):
            b = min(n, a + chunk)
            h = hidden[a:b]
            with torch.no_grad():
                d_logits = _chunk_logits(h, weight, bias, a, spans, factors).sub_(lse[a:b, None]).exp_()
            d_logits.mul_(-g_row[a:b, None])
            ea, eb = bounds[c], bounds[c + 1]
            if ea < eb:
                local = cols[ea:eb] - v0
                own = (local >= 0) & (local < v)
                d_logits.index_put_(((rows[ea:eb] - a)[own], local[own]), grad_out[ea:eb][own], accumulate=True)
            if need_b:
                d_b += d_logits.sum(0)
            d_y = d_logits.to(dtype)
            del d_logits
            if need_h:
                d_h[a:b] = d_y @ weight.to(dtype)
            if need_w:
                d_w += d_y.t() @ h
            for i, (start, end, scale) in enumerate(spans):
                lo, hi = max(start, a), min(end, b)
                if lo >= hi:
                    continue
                A, B = factors[2 * i].to(dtype), factors[2 * i + 1].to(dtype)
                x, dy = h[lo - a : hi - a], d_y[lo - a : hi - a]
                dy_b = dy @ B
                if need_h:
                    d_h[lo:hi].addmm_(dy_b, A, alpha=scale)
                if need_f[2 * i]:
                    d_f[2 * i] += (scale * (dy_b.t() @ x)).float()
                if need_f[2 * i + 1]:
                    d_f[2 * i + 1] += (scale * (dy.t() @ F.linear(x, A))).float()
        grads_f = [None if g is None else g.to(f.dtype) for g, f in zip(d_f, factors)]
        return (d_h, None if d_w is None else d_w.to(weight.dtype), None if d_b is None else d_b.to(bias.dtype),
                None, None, None, None, None, None, None, *grads_f)
