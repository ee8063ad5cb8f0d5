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

from tinsmith.models.chunked_logprobs import (UnembedLora, _chunk_logits, check_shapes, chunk_plan, chunked_backward,
                                              chunks)
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
    check_shapes(hidden, weight)
    chunk, bounds, spans, factors = chunk_plan(hidden, weight, rows, loras, chunk_rows, rows_host)
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
        for c, a, b in chunks(n, chunk):
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
        bounds, v0, v = ctx.bounds, ctx.vocab_start, weight.shape[0]

        def scatter(d_logits, c, a, g):
            """Only the chosen tokens in this rank's block of columns land here."""
            ea, eb = bounds[c], bounds[c + 1]
            if ea < eb:
                local = cols[ea:eb] - v0
                own = (local >= 0) & (local < v)
                d_logits.index_put_(((rows[ea:eb] - a)[own], local[own]), g[ea:eb][own], accumulate=True)

        d_h, d_w, d_b, *grads_f = chunked_backward(ctx, grad_out, hidden, weight, bias, rows, lse, factors, 10,
                                                   scatter)
        return (d_h, d_w, d_b, None, None, None, None, None, None, None, *grads_f)
