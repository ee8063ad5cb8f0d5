"""RMSNorm as one kernel when sampling on a GPU.

The models normalise the way Hugging Face does, so that bf16 results match it: the input cast to
fp32, normalised, cast back to the input's dtype, then scaled by the weight in that dtype
(:func:`tinsmith.models.layers.rms_norm`). In torch that is four kernels (the cast up, the norm,
the cast down, the scale) for every norm of every layer: three norms a layer (before attention,
the q/k heads', before the MLP), about 330 of a Qwen3-1.7B decode step's kernels. At decode sizes
each of them is launch and tail, not work. :func:`rms_norm` does the same arithmetic, in the same
order and dtypes, in one; :func:`add_rms_norm` also does the residual add before the norm (the
add after attention and the one after the MLP, which the next layer's norm takes).

Inference only (no autograd): training keeps the torch path. The input may be a strided view of
``rows x heads`` vectors (the q/k heads of a packed q/k/v output); the weight has one row, or one
row per head (q's weight for q's heads, k's for k's).
"""

from __future__ import annotations

import torch

from tinsmith.kernels import lora_gather, pdl
from tinsmith.kernels.guard import KernelGuard

try:  # optional: ``pip install 'tinsmith[gpu]'``
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# "auto": the kernel for CUDA tensors outside autograd, torch for the rest; "torch"; "triton": the
# kernel wherever no gradient is needed (CPU tensors need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("RMSNorm kernel", "normalising in torch")


def allowed(x: torch.Tensor) -> bool:
    """Whether the kernel may run for ``x`` at all: outside autograd (sampling, no-grad forwards),
    where :data:`BACKEND` sends ``x``, and not once it failed to build or launch here (:data:`GUARD`)."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None:
        return False
    return not ((BACKEND == "auto" and not x.is_cuda) or torch.is_grad_enabled())  # the CPU's norms: asked first


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` takes the kernel for ``x`` (:func:`allowed`) and ``weight``."""
    if not allowed(x):
        return False
    if x.dim() < 2 or x.stride(-1) != 1 or weight.stride(-1) != 1 or x.shape[-1] != weight.shape[-1]:
        return False
    if weight.dtype != x.dtype:  # torch's product would promote; the kernel writes x's dtype
        return False
    return weight.dim() == 1 or (x.dim() >= 3 and weight.shape[0] == x.shape[-2])


def rotary_usable(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` can also turn ``x`` (..., heads, d) by ``cos``/``signed_sin``
    (..., 1, d), as :func:`tinsmith.models.layers.apply_rotary` does: full-width rotary only."""
    d = x.shape[-1]
    return (x.dim() >= 3 and d % 2 == 0 and cos.shape == signed_sin.shape and cos.shape[-2:] == (1, d)
            and cos.shape[:-2] == x.shape[:-2] and cos.dtype == signed_sin.dtype == x.dtype
            and cos.is_contiguous() and signed_sin.is_contiguous())


def add_usable(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` takes the kernel: as :func:`usable`, one weight row, and a
    ``delta`` of ``x``'s shape and dtype, both contiguous."""
    return (usable(x, weight) and weight.dim() == 1 and delta.shape == x.shape and delta.dtype == x.dtype
            and x.is_contiguous() and delta.is_contiguous())


def turn_usable(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether :func:`turn` takes the kernel for heads ``x`` (..., heads, d) (:func:`allowed`): unit
    stride in ``d`` and a full-width rotary (:func:`rotary_usable`)."""
    return allowed(x) and x.dim() >= 3 and x.stride(-1) == 1 and rotary_usable(x, cos, signed_sin)


def store_usable(x: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor, split: int) -> bool:
    """Whether :func:`rms_norm` can also store a decode step's keys and values (``store``): one
    position a row (``x`` (rows, 1, heads, d)), the heads from ``split`` on the keys, ``v`` (rows,
    1, heads - split, d) with unit stride in ``d``, and contiguous pools of ``x``'s dtype with as
    many heads and ``d`` (what :mod:`tinsmith.kernels.kv_store` writes into)."""
    hk = x.shape[-2] - split
    return (x.dim() == 4 and x.shape[1] == 1 and v.shape == (x.shape[0], 1, hk, x.shape[-1]) and v.stride(-1) == 1
            and K.is_contiguous() and V.is_contiguous() and K.dtype == V.dtype == v.dtype == x.dtype
            and K.shape == V.shape and K.shape[1] == hk and K.shape[-1] == x.shape[-1])


def lora_usable(x: torch.Tensor, v: torch.Tensor, h: torch.Tensor, B: torch.Tensor,
                h_offsets: torch.Tensor) -> bool:
    """Whether a decode step's kernel that turns packed q/k heads ``x`` (rows, 1, heads, d) and stores
    values ``v`` (see :func:`store_usable`) can also add their bank's deltas (``lora``): ``x``'s
    heads the first columns of the packed output, one every ``d``, ``v``'s further along the same
    rows, and the bank's ``B`` (positions, columns, R) and ``h`` (rows, parts x R) fp32 with unit
    stride along the rank, ``h_offsets`` one per column."""
    d, rows = x.shape[-1], x.shape[0]
    el = x.element_size()
    v_col = (v.data_ptr() - x.data_ptr()) // el
    return (x.dim() == 4 and x.stride(-2) == d and v.stride(-2) == d and v.stride(0) == x.stride(0)
            and 0 < v_col and v_col + v.shape[-2] * d <= B.shape[1] and x.shape[-2] * d <= v_col
            and B.dim() == 3 and B.stride(-1) == 1 and h.dtype == torch.float32 and h.dim() == 2
            and h.shape[0] == rows and h.stride(-1) == 1 and h_offsets.shape == (B.shape[1],)
            and B.dtype == x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
             second: tuple[int, torch.Tensor] | None = None,
             store: tuple[torch.Tensor, ...] | None = None,
             lora: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """``weight * F.rms_norm(x.float(), eps=eps).to(x.dtype)`` in one kernel (a new contiguous
    tensor), or None when the kernel failed here (the caller takes the torch path).

    ``x`` (..., heads, d) with unit stride in ``d``, its heads at any stride and everything before
    them flattening into one stride; ``weight`` (d,) or (heads, d). ``rotary``: ``(cos,
    signed_sin)`` (see :func:`rotary_usable`), applied to the normalised vectors in the same
    kernel with :func:`tinsmith.models.layers.apply_rotary`'s roundings (the q/k heads' norm
    then their rotary: one kernel instead of five). ``second``: ``(s, weight2)``, the heads from
    ``s`` on scale by ``weight2`` (d,) instead of ``weight`` (d,): the q heads and the k heads of
    a packed q/k/v output, each norm with its own weight, without stacking the two per step.
    ``store``: ``(K, V, v, page, at)`` (with ``second``; see :func:`store_usable`): a decode step's
    new keys, the heads from ``s`` on as they come out, are also written to ``K[page[r], :,
    at[r]]`` and the row's ``v`` to ``V`` there, as :func:`tinsmith.kernels.kv_store.store` writes
    them, in this kernel instead of one of their own (one launch less per attention layer and step).
    ``lora`` (with ``store``; see :func:`lora_usable`): ``(h, B, idx, h_offsets)``, the packed q/k/v
    bank's expand left to this kernel (:class:`tinsmith.models.lora_bank.PendingExpand`): each row's
    deltas are added to its q/k heads and values as they are loaded, as the expand would have added
    and rounded them (another launch less); ``x`` and ``v`` are only read.
    """
    d = x.shape[-1]
    per_head = weight.dim() == 2 or second is not None
    heads = x.shape[-2] if per_head else 1
    vectors = x if per_head else x.unflatten(-1, (1, d))  # (..., heads, d), heads = 1 for a plain norm
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    flat = vectors.reshape(-1, heads, d)  # a view where the leading dimensions share one stride
    turn = None if rotary is None else tuple(t.reshape(-1, d) for t in rotary)
    split, w2 = second if second is not None else (heads, weight)
    return GUARD.call(_launch, flat, weight.reshape(-1, d), w2.reshape(-1, d), split, out, eps, turn, None, store,
                      lora, on=x)


def turn(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, split: int | None = None,
         store: tuple[torch.Tensor, ...] | None = None,
         lora: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """:func:`tinsmith.models.layers.apply_rotary` of heads ``x`` (..., heads, d) in one kernel, with
    its roundings (a new contiguous tensor), or None when the kernel failed here: the rotary of a
    model without q/k norms (Llama), four torch kernels otherwise. ``store`` (with ``split``, the
    first key head; see :func:`rms_norm`): a decode step's keys and values written to the K/V pools
    in the same kernel, and ``lora`` with it, the q/k/v bank's deltas added first (:func:`rms_norm`)."""
    d = x.shape[-1]
    heads = x.shape[-2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    flat = x.reshape(-1, heads, d)
    turn_ = tuple(t.reshape(-1, d) for t in (cos, signed_sin))
    return GUARD.call(_launch, flat, None, None, heads if split is None else split, out, 0.0, turn_, None, store,
                      lora, on=x)


def add_lora_usable(x: torch.Tensor, h: torch.Tensor, B: torch.Tensor, h_offsets: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` can also add a one-layer bank's deltas to ``delta`` (``lora``):
    the bank's ``B`` (positions, d, R) in ``x``'s dtype and ``h`` (rows, R) fp32, unit stride along
    the rank, ``h_offsets`` one per column."""
    d = x.shape[-1]
    return (B.dim() == 3 and B.shape[1] == d and B.stride(-1) == 1 and B.dtype == x.dtype
            and h.dtype == torch.float32 and h.dim() == 2 and h.shape == (x.numel() // max(d, 1), B.shape[2])
            and h.stride(-1) == 1 and h_offsets.shape == (d,))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 lora: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s, weight * F.rms_norm(s.float(), eps=eps).to(x.dtype))`` with ``s = x + delta`` rounded
    to ``x``'s dtype, in one kernel: a residual add and the norm after it (two new tensors), or
    None when the kernel failed here. See :func:`add_usable`.

    ``lora`` (see :func:`add_lora_usable`): ``(h, B, idx, h_offsets)``, the expand of the bank of
    the projection that made ``delta`` left to this kernel: each row's ``B[idx] @ h`` is first
    added to its ``delta`` as it is loaded, rounded as the expand rounds it (``delta`` is only
    read), by blocks of columns before the row is normalised (:data:`LORA_BLOCK`)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return total, out
    w = weight.reshape(-1, d)
    done = GUARD.call(_launch, x.reshape(-1, 1, d), w, w, 1, out, eps, None,
                      (delta.reshape(-1, d), total), None, lora, on=x)
    return None if done is None else (total, out)


# Columns a residual add takes at a time while adding a bank's deltas (a block of B's rows at
# every rank is held at once).
LORA_BLOCK = 256


def _launch(x: torch.Tensor, weight: torch.Tensor | None, weight2: torch.Tensor | None, split: int, out: torch.Tensor,
            eps: float, rotary: tuple[torch.Tensor, torch.Tensor] | None,
            residual: tuple[torch.Tensor, torch.Tensor] | None,
            store: tuple[torch.Tensor, ...] | None = None,
            lora: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """The kernel over ``x`` (vectors, heads, d); ``weight`` None: no norm (the rotary alone)."""
    n, heads, d = x.shape
    block = triton.next_power_of_2(d)
    norm = weight is not None
    if not norm:  # unread without NORM
        weight = weight2 = x
    cos, sin = rotary if rotary is not None else (x, x)  # unread without ROTARY
    delta, total = residual if residual is not None else (x, x)  # unread without RESIDUAL
    if store is not None:
        K, V, v, page, at = store
        v = v.reshape(n, heads - split, d)
        kv_strides = (v.stride(0), v.stride(1), K.stride(0), K.stride(1), K.stride(2))
    else:  # unread without STORE
        K = V = v = x
        page = at = x
        kv_strides = (0, 0, 0, 0, 0)
    if lora is not None:  # with STORE (lora_usable) or RESIDUAL (add_lora_usable)
        h, B, idx, h_offsets = lora
        R = B.shape[2]
        v_col = (v.data_ptr() - x.data_ptr()) // x.element_size() if store is not None else 0
        lora_args = (h, B, idx, h_offsets, h.stride(0), B.stride(0), B.stride(1), v_col)
        lora_const = dict(R=R, BLOCK_R=lora_gather.expand_block_r(R), LORA_CHUNK=min(block, LORA_BLOCK))
    else:  # unread without LORA
        lora_args = (x, x, x, x, 0, 0, 0, 0)
        lora_const = dict(R=1, BLOCK_R=1)
    warps = 4 if block >= 1024 or lora is not None else (2 if block >= 256 else 1)
    _rms_norm_kernel[(n * heads,)](
        x, weight, weight2, out, delta, total, cos, sin, heads, split, d, eps, x.stride(0), x.stride(1),
        weight.stride(0) if weight.shape[0] > 1 else 0, cos.stride(0), K, V, v, page, at, *kv_strides, *lora_args,
        BLOCK_D=block, ROTARY=rotary is not None, RESIDUAL=residual is not None, STORE=store is not None,
        NORM=norm, LORA=lora is not None, **lora_const, num_warps=warps, **pdl.options(x))
    return out


if triton is not None:

    @triton.jit
    def _weight(w_ptr, w2_ptr, head, split, stride_w, cols, mask):
        """The weight row of ``head``: row ``head`` of ``w_ptr`` (its one row when ``stride_w`` is 0)
        below ``split``, ``w2_ptr``'s one row from there."""
        if head < split:
            w = tl.load(w_ptr + head * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            w = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return w

    @triton.jit
    def _with_delta(x, first, cols, mask, slot, row, h_ptr, b_ptr, hoff_ptr, stride_hn, stride_bs, stride_bo,
                    dtype: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        """``x`` (fp32, a vector at columns ``first + cols`` of a packed projection's row) plus the
        row's adapter delta there, rounded to ``dtype``: the expand's sum and rounding. The vector's
        columns lie in one part, whose shrunk vector starts at ``h_offsets[first]``."""
        part = tl.load(hoff_ptr + first).to(tl.int64)
        b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + (first + cols)[:, None] * stride_bo
        delta = lora_gather.expand_block(h_ptr + row * stride_hn + part, b_rows, slot, mask, 1, 1, R, BLOCK_D,
                                         BLOCK_R)
        return (x + delta).to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, res_ptr, sum_ptr, cos_ptr, sin_ptr, heads, split, d, eps,
                         stride_row, stride_head, stride_w, stride_rot,
                         K_ptr, V_ptr, v_ptr, page_ptr, at_ptr, stride_vn, stride_vh, stride_page, stride_kh,
                         stride_pos, h_ptr, b_ptr, idx_ptr, hoff_ptr, stride_hn, stride_bs, stride_bo, v_col,
                         BLOCK_D: tl.constexpr, ROTARY: tl.constexpr, RESIDUAL: tl.constexpr,
                         STORE: tl.constexpr = False, NORM: tl.constexpr = True, LORA: tl.constexpr = False,
                         R: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1, LORA_CHUNK: tl.constexpr = 1,
                         PDL: tl.constexpr = False):
        """One vector: fp32 mean of squares, normalise, round to the input dtype, scale by the
        weight (in fp32, rounded once to the output dtype: what a bf16 product does). ``ROTARY``:
        then ``n * cos + roll(n, d/2) * signed_sin`` with each product and the sum rounded, as
        three bf16 operations round (the rolled half is normalised again from its own inputs).
        ``RESIDUAL`` (one head, contiguous rows; never with ``ROTARY``): the vector is first
        ``x + res`` rounded to the dtype, as a bf16 add rounds, and is written to ``sum_ptr`` too.
        ``STORE`` (one position a row): a head from ``split`` on (a key) is also written to its
        row's page and offset of the ``K`` pool, and the row's value of that head copied to ``V``.
        ``NORM`` off (with ``ROTARY``): the vector is turned as it is, neither normalised nor scaled.
        ``LORA`` (with ``STORE``): every vector loaded (the head, its rolled copy, the value) first
        gets its row's adapter delta for its columns of the packed output, rounded to the dtype
        as the expand rounds it (:func:`_with_delta`). ``LORA`` with ``RESIDUAL``: ``res`` gets
        the delta, ``LORA_CHUNK`` columns at a time (a whole row's block of B would not fit in
        registers): each block's sum is stored, then the row is read back whole and normalised."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        pid = tl.program_id(0).to(tl.int64)
        row = pid // heads
        head = pid % heads
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        base = x_ptr + row * stride_row + head * stride_head
        dtype = out_ptr.dtype.element_ty
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if LORA:
            adapter = tl.load(idx_ptr + row).to(tl.int64)
            if not RESIDUAL:
                x = _with_delta(x, head * stride_head, cols, mask, adapter, row, h_ptr, b_ptr, hoff_ptr, stride_hn,
                                stride_bs, stride_bo, dtype, R, BLOCK_D, BLOCK_R)
        if RESIDUAL:
            if LORA:
                for c0 in range(0, BLOCK_D, LORA_CHUNK):
                    part = c0 + tl.arange(0, LORA_CHUNK)
                    inside = part < d
                    xp = tl.load(base + part, mask=inside, other=0.0).to(tl.float32)
                    rp = tl.load(res_ptr + pid * d + part, mask=inside, other=0.0).to(tl.float32)
                    rp = _with_delta(rp, 0, part, inside, adapter, row, h_ptr, b_ptr, hoff_ptr, stride_hn, stride_bs,
                                     stride_bo, dtype, R, LORA_CHUNK, BLOCK_R)
                    tl.store(sum_ptr + pid * d + part, (xp + rp).to(dtype), mask=inside)
                tl.debug_barrier()  # the row's sums, stored by all of this program's threads, read back whole
                x = tl.load(sum_ptr + pid * d + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                total = (x + tl.load(res_ptr + pid * d + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
                tl.store(sum_ptr + pid * d + cols, total, mask=mask)
                x = total.to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
            w = _weight(w_ptr, w2_ptr, head, split, stride_w, cols, mask)
            normed = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype)
        else:
            normed = x.to(dtype)  # read from dtype: exact
        if ROTARY:
            rolled = (cols + d // 2) % d  # roll(x, d/2)[i] = x[(i - d/2) mod d]
            xr = tl.load(base + rolled, mask=mask, other=0.0).to(tl.float32)
            if LORA:
                xr = _with_delta(xr, head * stride_head, rolled, mask, adapter, row, h_ptr, b_ptr, hoff_ptr, stride_hn,
                                 stride_bs, stride_bo, dtype, R, BLOCK_D, BLOCK_R)
            if NORM:
                wr = _weight(w_ptr, w2_ptr, head, split, stride_w, rolled, mask)
                normed_r = (wr * (xr * rstd).to(dtype).to(tl.float32)).to(dtype)
            else:
                normed_r = xr.to(dtype)
            c = tl.load(cos_ptr + row * stride_rot + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + row * stride_rot + cols, mask=mask, other=0.0).to(tl.float32)
            a = (normed.to(tl.float32) * c).to(dtype).to(tl.float32)
            b = (normed_r.to(tl.float32) * s).to(dtype).to(tl.float32)
            normed = (a + b).to(dtype)
        tl.store(out_ptr + pid * d + cols, normed, mask=mask)
        if STORE:
            if head >= split:
                g = head - split
                slot = (tl.load(page_ptr + row).to(tl.int64) * stride_page + g * stride_kh
                        + tl.load(at_ptr + row).to(tl.int64) * stride_pos)
                tl.store(K_ptr + slot + cols, normed, mask=mask)
                value = tl.load(v_ptr + row * stride_vn + g * stride_vh + cols, mask=mask, other=0.0)
                if LORA:
                    value = _with_delta(value.to(tl.float32), v_col + g * stride_vh, cols, mask, adapter, row, h_ptr,
                                        b_ptr, hoff_ptr, stride_hn, stride_bs, stride_bo, dtype, R, BLOCK_D, BLOCK_R)
                tl.store(V_ptr + slot + cols, value, mask=mask)
