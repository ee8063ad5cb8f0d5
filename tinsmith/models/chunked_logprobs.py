"""Log-probabilities of chosen tokens straight from hidden states, a chunk of rows at a time.

Every loss reads ``log p(token | position)`` at a few tokens per position (one target, or K
candidates for distillation), never the whole distribution. Computing full ``(N, V)`` fp32
logits for that is the single biggest memory and elementwise cost of a training step on a large
vocabulary (8k tokens x 152k vocab = 5 GB). :func:`chunked_target_logprobs` instead runs the
unembedding (with any LoRA adapters on it) over a chunk of rows, reduces that chunk to its
logsumexp and the wanted entries, and drops it; backward recomputes each chunk's logits from
the saved hidden states and per-row logsumexp and fuses ``softmax - onehot`` with the matmuls
that give the gradients of the hidden states, the unembedding weight and its LoRA factors.

The arithmetic is the plain path's (``lm_head(h).float()``, then log-softmax): the product runs
in the hidden states' dtype and the softmax in fp32, so results agree with it to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from tinsmith.kernels import vocab_softmax

# Default memory allowed for one chunk's fp32 logits (backward holds about three such buffers).
DEFAULT_CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class UnembedLora:
    """A LoRA adapter on the unembedding for the rows ``[start, end)``: ``+ scale * h A^T B^T``."""

    A: torch.Tensor  # (rank, hidden)
    B: torch.Tensor  # (vocab, rank)
    scale: float
    start: int
    end: int


def rows_per_chunk(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many rows of fp32 logits fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def chunked_target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    loras: list[UnembedLora] | tuple[UnembedLora, ...] = (),
    chunk_rows: int | None = None,
    rows_host: torch.Tensor | None = None,
    one_per_row: bool = False,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight^T + bias + LoRA)[rows[e], cols[e]]`` for each element ``e``, fp32.

    ``hidden`` (N, H); ``weight`` (V, H); ``rows`` (E,) non-decreasing row indices and ``cols``
    (E,) token ids. LoRA row ranges must not overlap. ``chunk_rows`` defaults to
    :func:`rows_per_chunk` of the vocabulary. Differentiable in ``hidden``, ``weight``,
    ``bias`` and every adapter's ``A``/``B``; full-vocabulary logits never exist at once.
    ``rows_host``: ``rows`` on the host, where the chunks' element bounds are then found without
    reading the device (otherwise one read per call). ``one_per_row``: no row has two elements
    (one target per position, as the caller knows), what the fused gradient of half-precision
    logits on a GPU takes (:mod:`tinsmith.kernels.vocab_softmax`).
    """
    check_shapes(hidden, weight)
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError("rows and cols must be 1-D and of the same length")
    chunk, bounds, spans, factors = chunk_plan(hidden, weight, rows, loras, chunk_rows, rows_host)
    return _ChunkedTargetLogprobs.apply(hidden, weight, bias, rows, cols, chunk, bounds, spans, one_per_row, *factors)


def targets_to_elements(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` for targets of shape (N,) or (N, K): row-major, K entries per row."""
    n = targets.shape[0]
    k = 1 if targets.dim() == 1 else targets.shape[1]
    rows = torch.arange(n, device=targets.device).repeat_interleave(k)
    return rows, targets.reshape(-1)


def check_shapes(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise unless ``hidden`` (N, H) and ``weight`` (V, H) are 2-D with the same hidden size."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")


def chunk_plan(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
               loras: list[UnembedLora] | tuple[UnembedLora, ...], chunk_rows: int | None,
               rows_host: torch.Tensor | None) -> tuple[int, tuple[int, ...], tuple, list[torch.Tensor]]:
    """``(chunk, bounds, spans, factors)`` as the autograd functions take them: rows per chunk, each
    chunk's first element (plus the end), the adapters' ``(start, end, scale)`` and their flat
    ``A, B, A, B, ...`` factors (passed as separate inputs so autograd gives them gradients)."""
    chunk = chunk_rows or rows_per_chunk(weight.shape[0])
    spans = tuple((w.start, w.end, w.scale) for w in loras)
    factors = [t for w in loras for t in (w.A, w.B)]
    bounds = tuple(_element_bounds(rows if rows_host is None else rows_host, hidden.shape[0], chunk))
    return chunk, bounds, spans, factors


def chunks(n: int, chunk: int):
    """``(c, a, b)`` for each chunk ``c`` of rows ``[a, b)`` of ``n`` rows."""
    for c, a in enumerate(range(0, n, chunk)):
        yield c, a, min(n, a + chunk)


def chunked_backward(ctx, grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, rows: torch.Tensor, lse: torch.Tensor, factors: list,
                     factors_at: int, scatter, kept: torch.Tensor | None = None, fused_grad=None) -> tuple:
    """Gradients ``(d_hidden, d_weight, d_bias, *d_factors)`` of the chosen entries' log-probabilities.

    Shared by the single-device and the vocabulary-parallel functions, which differ only in how a
    chunk's incoming gradients land on its logits: ``scatter(d_logits, c, a, grad_out)`` adds
    them in place at the chunk's chosen (rows, columns) that the caller holds. ``factors_at``: the
    index of the first LoRA factor among the autograd function's inputs. ``kept``: the one chunk's
    log-softmax saved by forward, used instead of recomputing the logits. ``fused_grad(c, a, b, h,
    g_row)``: the chunk's logits' gradient in the compute dtype by other means (the kernels of
    :mod:`tinsmith.kernels.vocab_softmax`; not with a bias to train), or None where it cannot.
    """
    chunk, spans = ctx.chunk, ctx.spans
    need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    need_f = ctx.needs_input_grad[factors_at:]
    n, dtype = hidden.shape[0], hidden.dtype
    grad_out = grad_out.float()
    # Per-row sum of the incoming gradients: d logits = onehot-scatter(g) - softmax * sum(g).
    g_row = torch.zeros(n, dtype=torch.float32, device=hidden.device).index_add_(0, rows, grad_out)
    d_h = torch.empty_like(hidden) if need_h else None
    # Weight-sized gradients are summed over chunks in fp32, cast to their dtype at the end.
    d_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    d_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
    d_f = [torch.zeros(f.shape, dtype=torch.float32, device=f.device) if need else None
           for f, need in zip(factors, need_f)]
    for c, a, b in chunks(n, chunk):
        h = hidden[a:b]
        d_y = fused_grad(c, a, b, h, g_row) if fused_grad is not None and not need_b else None
        if d_y is None:
            if kept is not None:
                d_logits = kept.exp() if kept.dtype == torch.float32 else kept.float().sub_(lse[a:b, None]).exp_()
            else:
                with torch.no_grad():
                    d_logits = _chunk_logits(h, weight, bias, a, spans, factors).sub_(lse[a:b, None]).exp_()
            d_logits.mul_(-g_row[a:b, None])  # softmax * -sum(g), in place: one buffer
            scatter(d_logits, c, a, grad_out)
            if need_b:
                d_b += d_logits.sum(0)
            d_y = d_logits.to(dtype)
            del d_logits
        if need_h:
            d_h[a:b] = d_y @ weight.to(dtype)
        if need_w:
            d_w += d_y.t() @ h  # one chunk in the compute dtype, summed in fp32
        for i, (start, end, scale) in enumerate(spans):
            lo, hi = max(start, a), min(end, b)
            if lo >= hi:
                continue
            A, B = factors[2 * i].to(dtype), factors[2 * i + 1].to(dtype)
            x, dy = h[lo - a : hi - a], d_y[lo - a : hi - a]
            dy_b = dy @ B  # (rows, rank)
            if need_h:
                d_h[lo:hi].addmm_(dy_b, A, alpha=scale)
            if need_f[2 * i]:
                d_f[2 * i] += (scale * (dy_b.t() @ x)).float()
            if need_f[2 * i + 1]:
                d_f[2 * i + 1] += (scale * (dy.t() @ F.linear(x, A))).float()
    grads_f = [None if g is None else g.to(f.dtype) for g, f in zip(d_f, factors)]
    return (d_h, None if d_w is None else d_w.to(weight.dtype), None if d_b is None else d_b.to(bias.dtype),
            *grads_f)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: int,
                  spans: tuple, factors: tuple, fp32: bool = True) -> torch.Tensor:
    """Logits of the rows ``h`` (= rows ``[a, a + len(h))``), as ``LoraLinear`` computes them, in
    fp32 (``fp32=False``: in ``h``'s dtype, as the GEMMs wrote them)."""
    y = F.linear(h, weight, bias)
    b = a + h.shape[0]
    for i, (start, end, scale) in enumerate(spans):
        lo, hi = max(start, a), min(end, b)
        if lo >= hi:
            continue
        A, B = factors[2 * i].to(h.dtype), factors[2 * i + 1].to(h.dtype)
        # In place on the rows' slice (contiguous): no second chunk-sized buffer, no copy back.
        y[lo - a : hi - a].addmm_(F.linear(h[lo - a : hi - a], A), B.t(), alpha=scale)
    return y.float() if fp32 else y


def _element_bounds(rows: torch.Tensor, n: int, chunk: int) -> list[int]:
    """Index of the first element of each chunk of rows (plus the end), ``rows`` being sorted:
    found on the host when ``rows`` is there (no wait for the device), else on ``rows``' device
    and read back."""
    if rows.device.type == "cpu":
        starts = np.minimum(np.arange(0, n + chunk, chunk), n)
        return np.searchsorted(rows.numpy(), starts).tolist()
    starts = torch.arange(0, n + chunk, chunk, device=rows.device).clamp(max=n)
    return torch.searchsorted(rows, starts).tolist()


class _ChunkedTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, cols, chunk, bounds, spans, one_per_row, *factors):
        n = hidden.shape[0]
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        fused = vocab_softmax.usable(hidden)  # half-precision logits reduced by a kernel, never cast
        # One chunk covers every row: its log-softmax (fused: its logits) is kept for backward (it
        # is within the memory budget by definition) rather than recomputed by a second GEMM.
        kept = None
        for c, a, b in chunks(n, chunk):
            logits = _chunk_logits(hidden[a:b], weight, bias, a, spans, factors, fp32=not fused)
            chunk_lse = vocab_softmax.row_logsumexp(logits) if fused else None
            if chunk_lse is None:  # torch (or the kernel failed here: from now on torch)
                logits = logits.float()
                chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[a:b] = chunk_lse
            ea, eb = bounds[c], bounds[c + 1]
            if logits.dtype == torch.float32:
                logp = logits.sub_(lse[a:b, None])
                if ea < eb:
                    out[ea:eb] = logp[rows[ea:eb] - a, cols[ea:eb]]
            elif ea < eb:
                out[ea:eb] = logits[rows[ea:eb] - a, cols[ea:eb]].float() - lse[rows[ea:eb]]
            if n <= chunk and any(ctx.needs_input_grad):
                kept = logits
        ctx.save_for_backward(hidden, weight, bias, rows, cols, lse, kept, *factors)
        ctx.chunk, ctx.bounds, ctx.spans, ctx.one_per_row = chunk, bounds, spans, one_per_row
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, rows, cols, lse, kept, *factors = ctx.saved_tensors
        bounds = ctx.bounds

        def scatter(d_logits, c, a, g):
            ea, eb = bounds[c], bounds[c + 1]
            if ea < eb:
                d_logits.index_put_((rows[ea:eb] - a, cols[ea:eb]), g[ea:eb], accumulate=True)

        target = None
        if ctx.one_per_row and vocab_softmax.usable(hidden):
            # Each row's one target column (-1: a row with none); its gradient is g_row's.
            target = torch.full((hidden.shape[0],), -1, dtype=torch.int64, device=hidden.device)
            target[rows] = cols

        def fused_grad(c, a, b, h, g_row):
            if kept is not None:
                if kept.dtype == torch.float32:
                    return None
                return vocab_softmax.softmax_grad_(kept, lse[a:b], g_row[a:b], target[a:b], out=torch.empty_like(kept))
            with torch.no_grad():
                logits = _chunk_logits(h, weight, bias, a, ctx.spans, factors, fp32=False)
            return vocab_softmax.softmax_grad_(logits, lse[a:b], g_row[a:b], target[a:b])

        d_h, d_w, d_b, *grads_f = chunked_backward(ctx, grad_out, hidden, weight, bias, rows, lse, factors, 9,
                                                   scatter, kept, None if target is None else fused_grad)
        return (d_h, d_w, d_b, None, None, None, None, None, None, *grads_f)
