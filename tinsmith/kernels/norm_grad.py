"""RMSNorm and rotary embeddings with their backward, as one kernel each way, for training on a GPU.

Under autograd the torch path of a Hugging Face-style norm (the input cast to fp32, normalised,
cast back, scaled by the weight) is four kernels forward and as many backward, and it keeps an
fp32 copy of its input for the backward: 4 bytes per element of every norm's input (the hidden
states twice a layer, the q and k heads once), held from the forward to the backward. The rotary
after the q/k norm (``x cos + roll(x) sin``) is another four kernels each way. Liger's and
Unsloth's kernels are the model: here one kernel normalises (and, for the q/k heads, turns) each
vector, keeping only the input in its own dtype and one fp32 scale per vector; one kernel takes
the gradient back through both, recomputing the normalised vector, and writes per-program sums
of the weight's gradient (full fine-tuning; LoRA's norm weights are frozen and skip it).

The arithmetic follows the torch path's roundings, so bf16 training matches it within bf16's
noise and fp32 training within fp32's: forward as :mod:`tinsmith.kernels.rms_norm` (normalised
vectors rounded to the dtype, then scaled and rounded, then each rotary product and the sum
rounded), backward as autograd does it (each product's gradient rounded to the dtype, the norm's
own backward in fp32). Inference keeps :mod:`tinsmith.kernels.rms_norm`, which also handles
strided inputs and residual adds.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import rms_norm as rms_kernel
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernels for CUDA tensors under autograd, torch for the rest; "torch"; "triton": the
# kernels for any tensor under autograd (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("RMSNorm/rotary training kernels", "normalising and turning in torch")
TILE = 2048  # elements a program takes at once (several short vectors, or one long one)


def usable(x: torch.Tensor, weight: torch.Tensor | None = None, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> bool:
    """Whether :func:`norm_rotary` takes the kernels for ``x`` (..., d): under autograd, vectors
    the kernels can address (:func:`layout`), a weight of ``x``'s dtype with one row (``None``:
    rotary alone), and a full-width rotary whose ``(cos, signed_sin)`` (..., 1, d) match ``x``'s
    leading dimensions."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None or not torch.is_grad_enabled():
        return False
    if (BACKEND == "auto" and not x.is_cuda) or layout(x) is None or x.numel() == 0:
        return False
    d = x.shape[-1]
    if weight is not None and (weight.shape != (d,) or weight.dtype != x.dtype or not weight.is_contiguous()):
        return False
    if rotary is None:
        return weight is not None
    cos, sin = rotary
    return rms_kernel.rotary_usable(x, cos, sin) and not cos.requires_grad and not sin.requires_grad


def layout(x: torch.Tensor) -> tuple[int, int] | None:
    """``(inner, outer)``: vector ``v`` of ``x`` (..., d) starts at element ``(v // inner) * outer +
    (v % inner) * d`` of its storage from ``x``'s first. A contiguous ``x`` is one case (``inner``
    its heads, ``outer`` their width); the heads of a token may also sit in a wider row, as q or
    k in several tenants' q/k/v output side by side (``outer`` the row's width). None: vectors
    strided otherwise."""
    if x.dim() < 2 or x.stride(-1) != 1:
        return None
    d = x.shape[-1]
    if x.dim() == 2:
        return 1, x.stride(0)
    if x.stride(-2) != d:
        return None
    for i in range(x.dim() - 3):  # the dimensions before the heads' row must merge into one
        if x.stride(i) != x.shape[i + 1] * x.stride(i + 1):
            return None
    return x.shape[-2], x.stride(-3)


def norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """``apply_rotary(rms_norm(x, weight, eps), cos, signed_sin)`` with autograd, its parts as
    :func:`tinsmith.models.layers.rms_norm` and :func:`tinsmith.models.layers.apply_rotary` compute
    them: the norm alone (``rotary`` None), the rotary alone (``weight`` None) or both. None when
    the kernels failed here (the caller takes the torch path). See :func:`usable`."""
    cos, sin = rotary if rotary is not None else (None, None)
    if GUARD.failed is not None:
        return None
    try:
        return _NormRotary.apply(x, weight, cos, sin, eps)
    except _Declined:
        return None


class _Declined(Exception):
    """The forward kernel failed and :data:`GUARD` switched the kernels off."""


class _NormRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        d = x.shape[-1]
        heads = x.shape[-2] if cos is not None else 1
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device).view(-1, d)
        rstd = torch.empty(out.shape[0] if weight is not None else 0, dtype=torch.float32, device=x.device)
        if GUARD.call(_forward, x, weight, cos, sin, out, rstd, heads, eps, on=x) is None:
            raise _Declined
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        ctx.heads = heads
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[1]
        d = x.shape[-1]
        g = grad.contiguous().view(-1, d)
        done = GUARD.call(_backward, x, weight, rstd, cos, sin, g, ctx.heads, want_w, on=x)
        if done is None:  # the backward kernel failed here: the same arithmetic in torch
            done = backward_in_torch(x, weight, rstd, cos, sin, grad, want_w)
        gx, gw = done
        return gx.view(x.shape), gw, None, None, None


def backward_in_torch(x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, cos: torch.Tensor | None,
                      sin: torch.Tensor | None, grad: torch.Tensor, want_w: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels' backward in torch (where the backward kernel cannot run), with autograd's
    roundings: through the rotary (each product's gradient rounded), the scale, then the norm in fp32."""
    dtype, d = x.dtype, x.shape[-1]
    gy = grad
    if cos is not None:
        gy = grad * cos + (grad * sin).roll(d // 2, -1)
    if weight is None:
        return gy, None
    nhat = x.float() * rstd.view(*x.shape[:-1], 1)
    gn = (gy * weight).float()
    gx = (rstd.view(*x.shape[:-1], 1) * (gn - nhat * (gn * nhat).mean(-1, keepdim=True))).to(dtype)
    gw = (gy * nhat.to(dtype)).reshape(-1, d).sum(0, dtype=torch.float32).to(weight.dtype) if want_w else None
    return gx, gw


def _tile(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): one program's ``ROWS`` vectors of ``d`` (padded to a power of 2)."""
    block = triton.next_power_of_2(d)
    rows = max(1, TILE // block)
    return block, rows, 8 if rows * block >= 4096 else 4


def _forward(x, weight, cos, sin, out, rstd, heads: int, eps: float):
    n, d = out.shape
    inner, outer = layout(x)  # type: ignore[misc]
    block, rows, warps = _tile(d)
    w = weight if weight is not None else x  # unread without NORM
    c, s = (cos, sin) if cos is not None else (x, x)  # unread without ROTARY
    _forward_kernel[(triton.cdiv(n, rows),)](
        x, w, out, rstd, c, s, n, heads, d, inner, outer, eps,
        BLOCK_D=block, ROWS=rows, NORM=weight is not None, ROTARY=cos is not None, num_warps=warps)
    return out


def _programs(n: int, rows: int, device: torch.device) -> int:
    """Programs for the backward: each loops over tiles, so that the weight's per-program partial
    sums stay few (a few per multiprocessor), and the interpreter runs several (tests)."""
    tiles = triton.cdiv(n, rows)
    if device.type == "cuda":
        return min(tiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(tiles, 3)


def _backward(x, weight, rstd, cos, sin, grad, heads: int, want_w: bool):
    n, d = grad.shape
    inner, outer = layout(x)  # type: ignore[misc]
    block, rows, warps = _tile(d)
    programs = _programs(n, rows, x.device)
    gx = torch.empty_like(grad)
    partial = torch.empty(programs if want_w else 0, d, dtype=torch.float32, device=x.device)
    w = weight if weight is not None else x
    c, s = (cos, sin) if cos is not None else (x, x)
    _backward_kernel[(programs,)](
        x, w, rstd, grad, gx, partial, c, s, n, heads, d, inner, outer, programs,
        BLOCK_D=block, ROWS=rows, NORM=weight is not None, ROTARY=cos is not None, WEIGHT_GRAD=want_w,
        num_warps=warps)
    return gx, (partial.sum(0).to(weight.dtype) if want_w else None)


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, cos_ptr, sin_ptr, n, heads, d, inner, outer, eps,
                        BLOCK_D: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, ROTARY: tl.constexpr):
        """``ROWS`` vectors: ``NORM``, ``w * (x * rstd)`` (rstd of fp32 squares; the normalised vector
        rounded to the dtype, the product rounded), storing rstd; then ``ROTARY``, ``y cos +
        roll(y, d/2) signed_sin`` with vector ``v``'s cos/sin row ``v // heads`` (each product and
        the sum rounded; the rolled half is normalised again from its own inputs). The input's
        vectors are where :func:`layout` says (``inner``, ``outer``); the output is contiguous."""
        vec = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        rolled = (cols + d // 2) % d  # roll(y, d/2)[i] = y[(i - d/2) mod d] = y[(i + d/2) mod d]
        live = (vec < n)[:, None] & (cols < d)[None, :]
        dtype = out_ptr.dtype.element_ty
        at = vec[:, None] * d
        at_x = ((vec // inner) * outer + (vec % inner) * d)[:, None]
        y = tl.load(x_ptr + at_x + cols[None, :], mask=live, other=0.0).to(tl.float32)
        if ROTARY:
            yr = tl.load(x_ptr + at_x + rolled[None, :], mask=live, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(y * y, axis=1) / d + eps)
            tl.store(rstd_ptr + vec, rstd, mask=vec < n)
            w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
            y = (w[None, :] * (y * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            if ROTARY:
                wr = tl.load(w_ptr + rolled, mask=cols < d, other=0.0).to(tl.float32)
                yr = (wr[None, :] * (yr * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if ROTARY:
            turn = (vec // heads)[:, None] * d + cols[None, :]
            c = tl.load(cos_ptr + turn, mask=live, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + turn, mask=live, other=0.0).to(tl.float32)
            y = (y * c).to(dtype).to(tl.float32) + (yr * s).to(dtype).to(tl.float32)
        tl.store(out_ptr + at + cols[None, :], y.to(dtype), mask=live)

    @triton.jit
    def _backward_kernel(x_ptr, w_ptr, rstd_ptr, g_ptr, gx_ptr, gw_ptr, cos_ptr, sin_ptr, n, heads, d, inner, outer,
                         programs,
                         BLOCK_D: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, ROTARY: tl.constexpr,
                         WEIGHT_GRAD: tl.constexpr):
        """Tiles ``pid``, ``pid + programs``, ... of ``ROWS`` vectors: the output's gradient back through
        the rotary (``g cos + roll(g signed_sin, d/2)``, each product rounded, then the sum), the
        scale (``gy w`` rounded) and the norm in fp32 (``rstd (gn - n mean(gn n))``, the normalised
        vector ``n`` recomputed from the input); ``WEIGHT_GRAD``: this program's sum of ``gy n``
        over its vectors, to row ``pid`` of ``gw_ptr``."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        rolled = (cols + d // 2) % d
        dtype = gx_ptr.dtype.element_ty
        if NORM:
            w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
        if WEIGHT_GRAD:
            gw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(pid * ROWS, n, programs * ROWS):
            vec = first + tl.arange(0, ROWS).to(tl.int64)
            live = (vec < n)[:, None] & (cols < d)[None, :]
            at = vec[:, None] * d  # the gradients' (contiguous)
            gy = tl.load(g_ptr + at + cols[None, :], mask=live, other=0.0).to(tl.float32)
            if ROTARY:
                turn = (vec // heads)[:, None] * d
                c = tl.load(cos_ptr + turn + cols[None, :], mask=live, other=0.0).to(tl.float32)
                gr = tl.load(g_ptr + at + rolled[None, :], mask=live, other=0.0).to(tl.float32)
                sr = tl.load(sin_ptr + turn + rolled[None, :], mask=live, other=0.0).to(tl.float32)
                gy = ((gy * c).to(dtype).to(tl.float32) + (gr * sr).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            if NORM:
                rstd = tl.load(rstd_ptr + vec, mask=vec < n, other=0.0)
                at_x = ((vec // inner) * outer + (vec % inner) * d)[:, None]  # the input's (see layout)
                nhat = tl.load(x_ptr + at_x + cols[None, :], mask=live, other=0.0).to(tl.float32) * rstd[:, None]
                gn = (gy * w[None, :]).to(dtype).to(tl.float32)
                gx = rstd[:, None] * (gn - nhat * (tl.sum(gn * nhat, axis=1) / d)[:, None])
                if WEIGHT_GRAD:
                    gw += tl.sum(gy * nhat.to(dtype).to(tl.float32), axis=0)
            else:
                gx = gy
            tl.store(gx_ptr + at + cols[None, :], gx.to(dtype), mask=live)
        if WEIGHT_GRAD:
            tl.store(gw_ptr + pid * d + cols, gw, mask=cols < d)


__all__ = ["BACKEND", "backward_in_torch", "layout", "norm_rotary", "usable"]
