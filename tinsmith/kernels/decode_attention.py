"""Decode attention over the row K/V cache, reading only each row's own positions.

A decode step asks one query per row to attend over that row's cached keys. Through SDPA the
step reads K/V at one common span for every row, the longest row's (or, in a captured CUDA
graph, the cache's whole capacity) and masks the rest: rows of different lengths, and the
spare capacity a graph must cover, are read from memory for nothing, and decoding is bound by
exactly that memory traffic. This is the flash-decoding scheme of vLLM / SGLang's Triton
decode backends instead:

- stage 1, one program per (row, K/V head, split of the positions): the ``rep`` query heads
  that share the K/V head (grouped-query attention) go through the split's keys together, with
  an online softmax in fp32, and stop at the row's own key count (read from the device, so the
  step never asks the host and can be captured); it writes a partial output and its
  log-sum-exp;
- stage 2: the splits' partials combined, with gpt-oss' attention sink (one extra logit per
  head in the denominator) where the model has one, by the last of a (row, K/V head)'s split
  programs to finish: each takes a ticket after storing its partial (an atomic count, set back to
  zero by the last one, the LoRA shrink's counters), and the last one combines the splits in
  split order, so the result never depends on the scheduling and replays repeat bit for bit. A
  second kernel, one program per (row, query head), does it where there are more rows than
  counters (or ``COMBINE_IN_SPLITS`` is off). Where one split holds a row's every key (many rows:
  enough programs without splitting), stage 1 writes the output itself, sinks included.

Splitting the positions keeps the GPU busy when few rows decode long sequences; the split
count depends only on the number of rows, K/V heads and the span, all known on the host.

The torch path (SDPA with a mask, :meth:`tinsmith.sampling.kv_cache.RowKVCache.decode_attention`)
stays the CPU implementation and the reference the kernels are tested against (in Triton's
interpreter on a CPU).
"""

from __future__ import annotations

import torch

from tinsmith.kernels import pdl, tickets
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton, triton_available

if triton is not None:
    import triton.language as tl

# "auto": the kernels for CUDA tensors, torch for the rest; "torch"; "triton": the kernels for
# every tensor (CPU ones need TRITON_INTERPRET=1 set before triton is imported: tests do).
BACKEND = "auto"
MAX_SPLITS = 64
# Whether the last split program of a (row, K/V head) combines the splits (one launch); False: the
# combine kernel does, a second launch (benchmarks and tests compare the two).
COMBINE_IN_SPLITS = True
GUARD = KernelGuard("decode attention kernels", "decoding through SDPA")


def usable(q: torch.Tensor) -> bool:
    """Whether decode attention over tensors like ``q`` takes the kernels."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None:
        return False
    return BACKEND == "triton" or q.device.type == "cuda"


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, table_ptr, part_ptr, lse_ptr, sink_ptr, out_ptr, ticket_ptr,
                      scale, split_len, splits,
                      stride_qn, stride_qh, stride_kn, stride_kh, stride_kp, stride_vn, stride_vh, stride_vp,
                      stride_tn, stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on, stride_oh,
                      REP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PAGE: tl.constexpr, DIRECT: tl.constexpr,
                      SINKS: tl.constexpr, COMBINE: tl.constexpr, PDL: tl.constexpr = False):
        """Partial attention of K/V head ``g``'s ``REP`` query heads over one split of the row's keys.
        ``PAGE`` > 0: K/V are pools of pages of ``PAGE`` positions (``stride_kn`` a page's) and the
        row's page table says which page holds positions ``[j * PAGE, (j + 1) * PAGE)``.
        ``DIRECT`` (a single split: the row's every key): the heads' final output, written to
        ``out_ptr`` in its dtype, with ``SINKS``' logits in the denominators (no combine kernel).
        ``COMBINE``: the last of the (row, K/V head)'s ``splits`` programs to finish combines them
        into ``out_ptr`` (``ticket_ptr``: the pair's count of finished programs, zero before and after)."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        n_keys = tl.load(len_ptr + row).to(tl.int32)
        start = split * split_len
        end = tl.minimum(start + split_len, n_keys)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        h_mask = heads < REP
        d_mask = dims < D
        q_rows = q_ptr + row * stride_qn + (g * REP + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        if PAGE == 0:  # the row's own buffer
            k_rows = k_ptr + row * stride_kn + g * stride_kh + dims[None, :]
            v_rows = v_ptr + row * stride_vn + g * stride_vh + dims[None, :]
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for p0 in range(start, end, BLOCK_N):  # every block holds at least one key of the row
            pos = p0 + tl.arange(0, BLOCK_N)
            p_mask = pos < end
            kv_mask = p_mask[:, None] & d_mask[None, :]
            if PAGE > 0:  # a block never straddles two pages: BLOCK_N divides PAGE and p0 is a multiple
                page = tl.load(table_ptr + row * stride_tn + p0 // PAGE).to(tl.int64)
                k_rows = k_ptr + page * stride_kn + g * stride_kh + dims[None, :] - (p0 // PAGE * PAGE) * stride_kp
                v_rows = v_ptr + page * stride_vn + g * stride_vh + dims[None, :] - (p0 // PAGE * PAGE) * stride_vp
            k = tl.load(k_rows + pos[:, None].to(tl.int64) * stride_kp, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_H, BLOCK_N)
            scores = tl.where(p_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            probs = tl.exp(scores - m_new[:, None])
            denom = denom * alpha + tl.sum(probs, axis=1)
            v = tl.load(v_rows + pos[:, None].to(tl.int64) * stride_vp, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(probs, v, input_precision=PRECISION)
            m = m_new
        out_heads = (g * REP + heads)
        if DIRECT:  # every row has a key, so denom > 0
            if SINKS:  # the sink's share joins the denominator, as the combine kernel adds it
                sink = tl.load(sink_ptr + out_heads, mask=h_mask, other=0.0).to(tl.float32)
                top = tl.maximum(m, sink)
                acc = acc * tl.exp(m - top)[:, None]
                denom = denom * tl.exp(m - top) + tl.exp(sink - top)
            out = acc / denom[:, None]
            tl.store(out_ptr + row * stride_on + out_heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
        else:
            seen = denom > 0  # a split past the row's keys saw nothing: weight 0 in the combine
            out = acc / tl.where(seen, denom, 1.0)[:, None]
            lse = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
            tl.store(part_ptr + row * stride_pn + out_heads[:, None] * stride_ph + split * stride_ps + dims[None, :],
                     out, mask=h_mask[:, None] & d_mask[None, :])
            tl.store(lse_ptr + row * stride_ln + out_heads * stride_lh + split, lse, mask=h_mask)
            if COMBINE:
                counter = ticket_ptr + row * tl.num_programs(1) + g
                ticket = tickets.take(counter)
                last = h_mask & ((heads * 0 + ticket) == splits - 1)  # per element: interpreters differ on scalars
                lses = lse_ptr + row * stride_ln + out_heads * stride_lh
                top = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                for s in range(0, splits):
                    top = tl.maximum(top, tl.load(lses + s, mask=last, other=float("-inf"), cache_modifier=".cg"))
                if SINKS:
                    sink = tl.load(sink_ptr + out_heads, mask=last, other=0.0).to(tl.float32)
                    top = tl.maximum(top, sink)
                top = tl.where(last, top, 0.0)  # heads this program does not combine stay finite
                total = tl.zeros([BLOCK_H], dtype=tl.float32)
                mixed = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
                parts = part_ptr + row * stride_pn + out_heads[:, None] * stride_ph + dims[None, :]
                for s in range(0, splits):  # split order, whichever program came last
                    w = tl.exp(tl.load(lses + s, mask=last, other=float("-inf"), cache_modifier=".cg") - top)
                    total += w
                    mixed += w[:, None] * tl.load(parts + s * stride_ps, mask=last[:, None] & d_mask[None, :],
                                                  other=0.0, cache_modifier=".cg")
                if SINKS:
                    total += tl.where(last, tl.exp(sink - top), 0.0)
                total = tl.where(last, total, 1.0)
                tl.store(out_ptr + row * stride_on + out_heads[:, None] * stride_oh + dims[None, :],
                         (mixed / total[:, None]).to(out_ptr.dtype.element_ty), mask=last[:, None] & d_mask[None, :])
                tickets.hand_back(counter, ticket, splits, BLOCK_H)

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, sink_ptr, out_ptr, splits,
                        stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on, stride_oh,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
                        PDL: tl.constexpr = False):
        """One (row, query head): the splits' partial outputs weighted by their share of the softmax."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        s_mask = s < splits
        lse = tl.load(lse_ptr + row * stride_ln + head * stride_lh + s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        if SINKS:
            sink = tl.load(sink_ptr + head).to(tl.float32)
            m = tl.maximum(m, sink)
        w = tl.exp(lse - m)
        total = tl.sum(w, axis=0)
        if SINKS:
            total += tl.exp(sink - m)
        parts = tl.load(part_ptr + row * stride_pn + head * stride_ph + s[:, None] * stride_ps + dims[None, :],
                        mask=s_mask[:, None] & (dims < D)[None, :], other=0.0)
        out = tl.sum(parts * w[:, None], axis=0) / total
        tl.store(out_ptr + row * stride_on + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(n))


def split_plan(rows: int, kv_heads: int, span: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(splits, positions per split)`` for ``rows`` rows over at most ``span`` positions: enough
    programs to fill the GPU (two per multiprocessor), never a split of less than one block.
    Depends only on host-known sizes, so a captured step keeps its grid."""
    blocks = _cdiv(span, block_n)
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 1  # the interpreter: fewest programs (the splits are tested by setting ``splits``)
    splits = max(1, min(blocks, MAX_SPLITS, _cdiv(target, max(1, rows * kv_heads))))
    per = _cdiv(blocks, splits) * block_n
    return _cdiv(span, per), per


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n_keys: torch.Tensor, span: int,
                     sinks: torch.Tensor | None = None, splits: int | None = None,
                     table: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per row over that row's first ``n_keys[row]`` cached positions.

    q: (n, Hq, 1, d); K, V: (rows >= n, Hk, positions >= span, d), last dimension contiguous, or
    with ``table`` (n, pages) int32, pools of pages (pages, Hk, page size, d): row ``i``'s
    positions ``[j * page, (j + 1) * page)`` are in page ``table[i, j]`` (the page size a
    multiple of 64). ``n_keys`` (n,) on the device, each in 1..span; ``sinks`` (Hq,) gpt-oss'
    per-head sink logits. Returns (n, Hq, 1, d) in q's dtype, softmax at scale d ** -0.5 in fp32.
    ``splits`` fixes the number of position splits (tests); by default :func:`split_plan`.
    """
    n, hq, _, d = q.shape
    hk = K.shape[1]
    rep = hq // hk
    out = torch.empty(n, hq, 1, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    qv = q[:, :, 0]
    if qv.stride(-1) != 1:
        qv = qv.contiguous()
    assert K.stride(-1) == 1 and V.stride(-1) == 1, "the cache's head dimension must be contiguous"
    cpu = q.device.type == "cpu"
    block_n = 64 if cpu else 32
    if splits is None:
        splits, per = split_plan(n, hk, span, block_n, q.device)
    else:  # as asked, each split whole blocks
        per = _cdiv(_cdiv(span, splits), block_n) * block_n
        splits = _cdiv(span, per)
    direct = splits == 1  # one split holds the row's every key: it writes the output itself
    part = torch.empty(0 if direct else n, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(0 if direct else n, hq, splits, dtype=torch.float32, device=q.device)
    # The dots run on fp32 operands: tf32 holds bf16 and fp16 values exactly, so 16-bit caches lose
    # nothing to it (the probabilities keep tf32's 10 bits instead of being cut to bf16's 7); an fp32
    # cache is multiplied in full precision. Decoding is bound by reading K/V, not by these products.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = _pow2(d, 16)
    page = 0 if table is None else K.shape[2]
    assert page % block_n == 0, f"pages of {page} positions are not whole blocks of {block_n}"
    o = out[:, :, 0]
    sink_arg = sinks if sinks is not None else lse
    combine = not direct and COMBINE_IN_SPLITS and tickets.fits(n * hk)
    _split_kernel[(n, hk, splits)](
        qv, K, V, n_keys, n_keys if table is None else table, part, lse, sink_arg, o,
        tickets.counters(q.device) if combine else n_keys, d ** -0.5, per, splits,
        qv.stride(0), qv.stride(1), K.stride(0), K.stride(1), K.stride(2), V.stride(0), V.stride(1), V.stride(2),
        0 if table is None else table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), o.stride(0), o.stride(1),
        REP=rep, D=d, BLOCK_H=_pow2(rep, 16), BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=precision, PAGE=page,
        DIRECT=direct, SINKS=sinks is not None, COMBINE=combine, **pdl.options(q))
    if not direct and not combine:
        _combine_kernel[(n, hq)](
            part, lse, sink_arg, o, splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), o.stride(0), o.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_S=_pow2(splits, 2), SINKS=sinks is not None, **pdl.options(q))
    return out


def try_decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n_keys: torch.Tensor, span: int,
                         sinks: torch.Tensor | None = None, table: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`decode_attention`, or None (the caller takes the torch path) where the kernels cannot
    run: the first failure to build them on a GPU is logged, and torch serves from then on."""
    return GUARD.call(decode_attention, q, K, V, n_keys, span, sinks, table=table, on=q)


__all__ = ["BACKEND", "decode_attention", "split_plan", "try_decode_attention", "triton_available", "usable"]
