"""``silu(gate) * up`` as one kernel when sampling on a GPU.

The MLP of every dense family computes ``F.silu(gate) * up`` over the halves of its packed
gate/up output: two kernels a layer in torch (the SiLU into a new tensor, the product in place),
each at decode sizes mostly launch and tail. :func:`silu_mul` does the same arithmetic in one,
with torch's roundings: the SiLU in fp32 (``g / (1 + exp(-g))``) rounded to the input dtype, then
the product rounded once.

Under autograd (training) :func:`silu_mul_grad` takes the gate and up projections' outputs as two
tensors and keeps only them for the backward (torch keeps the SiLU's output too: one more tensor
of the MLP's width per token, held from the forward to the backward), and one kernel each way
replaces torch's two forward and four backward ones; the backward rounds as autograd does.
:func:`silu_mul_packed_grad` does the same for the two halves of one tensor (several tenants'
gate/up projections computed side by side): its backward writes both halves' gradients into one
tensor of the input's shape, so nothing concatenates them.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import lora_gather, pdl, tickets
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors outside autograd, torch for the rest; "torch"; "triton": the
# kernel wherever no gradient is needed (CPU tensors need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("SiLU-and-multiply kernel", "multiplying in torch")
BLOCK = 1024  # columns a program takes


def allowed(x: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` may run at all for tensors like ``x``: outside autograd, where
    :data:`BACKEND` sends ``x``, and not once the kernel failed here."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None:
        return False
    return not ((BACKEND == "auto" and not x.is_cuda) or torch.is_grad_enabled())


def usable(y: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` takes the kernel for ``y`` (rows, 2 x width): :func:`allowed`, its
    rows at one stride with unit stride along them."""
    return (allowed(y) and y.dim() == 2 and y.shape[1] % 2 == 0 and y.stride(-1) == 1
            and y.dtype.is_floating_point)


def lora_usable(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` can also add a gate/up bank's deltas (its expand left to it: ``h``
    (rows, 2 x R) fp32, the gate's shrunk vectors then the up's, ``B`` (positions, 2 x width, R))."""
    return (usable(y) and B.dim() == 3 and B.shape[1] == y.shape[1] and h.shape == (y.shape[0], 2 * B.shape[2])
            and h.dtype == torch.float32 and h.stride(-1) == 1 and B.stride(-1) == 1)


def grad_usable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether :func:`silu_mul_grad` takes the kernels: under autograd, two contiguous tensors of one
    shape and dtype, and not once the kernels failed here."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None or not torch.is_grad_enabled():
        return False
    if BACKEND == "auto" and not gate.is_cuda:
        return False
    return (gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype.is_floating_point
            and gate.is_contiguous() and up.is_contiguous() and gate.numel() > 0)


def packed_grad_usable(y: torch.Tensor) -> bool:
    """Whether :func:`silu_mul_packed_grad` takes the kernels: under autograd, a contiguous tensor
    whose last dimension holds the gate and up halves, and not once the kernels failed here."""
    if triton is None or BACKEND == "torch" or GUARD.failed is not None or not torch.is_grad_enabled():
        return False
    if BACKEND == "auto" and not y.is_cuda:
        return False
    return y.dtype.is_floating_point and y.is_contiguous() and y.shape[-1] % 2 == 0 and y.numel() > 0


def silu_mul_packed_grad(y: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(y[..., :i]) * y[..., i:]`` (``i`` half of the last dimension) with autograd, one
    kernel forward and one backward; None when the forward kernel failed here (the caller takes
    the torch path). See :func:`packed_grad_usable`."""
    if GUARD.failed is not None:
        return None
    try:
        return _SiluMulPacked.apply(y)
    except _Declined:
        return None


def silu_mul_grad(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` with autograd, one kernel forward and one backward; None when the
    forward kernel failed here (the caller takes the torch path). See :func:`grad_usable`."""
    if GUARD.failed is not None:
        return None
    try:
        return _SiluMul.apply(gate, up)
    except _Declined:
        return None


class _Declined(Exception):
    """The forward kernel failed and :data:`GUARD` switched the kernels off."""


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        out = torch.empty_like(gate)
        if GUARD.call(_launch_flat, _silu_mul_flat_kernel, gate, up, out, on=gate) is None:
            raise _Declined
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        g_gate, g_up = torch.empty_like(gate), torch.empty_like(up)
        if GUARD.call(_launch_flat, _silu_mul_backward_kernel, gate, up, grad, g_gate, g_up, on=gate) is None:
            return silu_mul_backward_in_torch(gate, up, grad)
        return g_gate, g_up


class _SiluMulPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        width = y.shape[-1] // 2
        flat = y.view(-1, 2 * width)
        out = torch.empty(flat.shape[0], width, dtype=y.dtype, device=y.device)
        if GUARD.call(_launch, flat, out, on=y) is None:
            raise _Declined
        ctx.save_for_backward(y)
        return out.view(*y.shape[:-1], width)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        width = y.shape[-1] // 2
        flat, g = y.view(-1, 2 * width), grad.contiguous().view(-1, width)
        gy = torch.empty_like(flat)
        if GUARD.call(_launch_packed_backward, flat, g, gy, on=y) is None:
            gate_grad, up_grad = silu_mul_backward_in_torch(flat[:, :width], flat[:, width:], g)
            gy = torch.cat((gate_grad, up_grad), dim=1)
        return gy.view(y.shape)


def _launch_packed_backward(y: torch.Tensor, grad: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    rows, width = grad.shape
    block = min(BLOCK, triton.next_power_of_2(width))
    _silu_mul_packed_backward_kernel[(rows, triton.cdiv(width, block))](y, grad, gy, width, BLOCK=block,
                                                                        num_warps=4 if block >= 512 else 1)
    return gy


def silu_mul_backward_in_torch(gate: torch.Tensor, up: torch.Tensor,
                               grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward kernel's arithmetic in torch (where it cannot run): autograd's roundings."""
    g = gate.float()
    sig = torch.sigmoid(g)
    g_act = (grad * up).float()
    return (g_act * sig * (1 + g * (1 - sig))).to(gate.dtype), grad * torch.nn.functional.silu(gate)


def _launch_flat(kernel, *tensors: torch.Tensor) -> torch.Tensor:
    """``kernel`` over the elements of ``tensors`` (one shape, contiguous), BLOCK a program."""
    n = tensors[0].numel()
    kernel[(triton.cdiv(n, BLOCK),)](*tensors, n, BLOCK=BLOCK, num_warps=4)
    return tensors[-1]


def silu_mul(y: torch.Tensor, lora: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """``F.silu(y[:, :i]) * y[:, i:]`` with ``i`` half of ``y``'s columns, as a new contiguous
    (rows, i) tensor; None when the kernel failed here (the caller takes the torch path).

    ``lora``: ``(h, B, idx, ...)``, a gate/up bank's expand left to this kernel
    (:class:`tinsmith.models.lora_bank.PendingExpand`, :func:`lora_usable`): each row's ``B[idx] @
    h`` is added to its gate and up values as they are loaded, as the expand would have added and
    rounded them; ``y`` is only read."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, width, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    return GUARD.call(_launch, y, out, lora, on=y)


def shrink_usable(out_rows: int, A: torch.Tensor, width: int) -> bool:
    """Whether :func:`silu_mul_shrinking` can take the next projection's shrink over a bank's ``A``
    (positions, R, width): its rank within one block of outputs, unit stride along the inputs, and
    a ticket counter for every row."""
    return (A.dim() == 3 and A.shape[2] == width and A.shape[1] <= SHRINK_MAX_RANK and A.stride(-1) == 1
            and tickets.fits(out_rows))


# The largest rank whose shrink the SiLU product takes (one block of outputs a program).
SHRINK_MAX_RANK = 64


def silu_mul_shrinking(y: torch.Tensor, lora: tuple[torch.Tensor, ...] | None, A: torch.Tensor,
                       idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`silu_mul`, and the down projection's bank shrink of its output in the same kernel:
    ``(out, h)``, ``h[row] = A[idx[row]] @ out[row]`` (rows, R) fp32, zeros for slot -1, or None
    when the kernel failed here. Each program multiplies its block of the product, as rounded and
    stored, by its adapter's block of ``A`` into a partial sum; the row's last program to finish
    adds the partials up in block order (:mod:`tinsmith.kernels.tickets`), so replays repeat bit
    for bit. See :func:`shrink_usable`."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, width, dtype=y.dtype, device=y.device)
    h = torch.empty(rows, A.shape[1], dtype=torch.float32, device=y.device)  # every row's last program writes it
    if out.numel() == 0:
        return out, h.zero_()
    done = GUARD.call(_launch, y, out, lora, (A, idx, h), on=y)
    return None if done is None else (out, h)


# Columns a program takes while adding adapters' deltas on a GPU (a block of B's rows at every
# rank is held at once): the expand's own width (lora_gather.EXPAND_BLOCK).
LORA_BLOCK = 128


def _launch(y: torch.Tensor, out: torch.Tensor, lora: tuple[torch.Tensor, ...] | None = None,
            shrink: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    rows, width = out.shape
    block = min(BLOCK, triton.next_power_of_2(width))
    if lora is None:
        h = B = y  # unread without LORA
        R = block_r = 1
    else:
        h, B = lora[:2]
        R = B.shape[2]
        block_r = lora_gather.expand_block_r(R)
    if (lora is not None or shrink is not None) and y.is_cuda:
        block = min(block, LORA_BLOCK)
    idx = lora[2] if lora is not None else (shrink[1] if shrink is not None else y)
    blocks = triton.cdiv(width, block)
    if shrink is None:
        A = partials = h_down = counters = y  # unread without SHRINK
        R2 = 1
    else:
        A, _, h_down = shrink
        R2 = A.shape[1]
        partials = torch.empty(rows, blocks, R2, dtype=torch.float32, device=y.device)
        counters = tickets.counters(y.device)
    _silu_mul_kernel[(rows, blocks)](
        y, out, width, y.stride(0), h, B, idx, h.stride(0), B.stride(0), B.stride(1), A, partials, h_down, counters,
        0 if shrink is None else A.stride(0), 0 if shrink is None else A.stride(1), R=R, BLOCK_R=block_r,
        LORA=lora is not None, SHRINK=shrink is not None, R2=R2, BLOCK_R2=max(16, triton.next_power_of_2(R2)),
        BLOCKS=blocks, BLOCK=block, num_warps=4 if block >= 512 or lora is not None or shrink is not None else 1,
        **pdl.options(y))
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(y_ptr, out_ptr, width, stride_row, h_ptr, b_ptr, idx_ptr, stride_hn, stride_bs, stride_bo,
                         a_ptr, part_ptr, hd_ptr, ticket_ptr, stride_as, stride_ar,
                         BLOCK: tl.constexpr, LORA: tl.constexpr = False, R: tl.constexpr = 1,
                         BLOCK_R: tl.constexpr = 1, SHRINK: tl.constexpr = False, R2: tl.constexpr = 1,
                         BLOCK_R2: tl.constexpr = 1, BLOCKS: tl.constexpr = 1, PDL: tl.constexpr = False):
        """Columns ``[pid1 * BLOCK, ...)`` of one row: the gate half's SiLU, rounded to the
        dtype, times the up half, rounded. ``LORA``: the row's adapter deltas first added to both
        halves, each rounded to the dtype as the expand rounds them (gate: ``h[row, :R]``, up:
        ``h[row, R:]``, through the row's ``B``; nothing for slot -1). ``SHRINK``: the block of the
        product, as stored, times the row's adapter's block of ``A`` (``R2`` outputs) is stored as
        this program's partial, and the row's last program to finish writes ``hd[row]``, the
        partials added in block order (zeros for slot -1)."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        dtype = out_ptr.dtype.element_ty
        g = tl.load(y_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + row * stride_row + width + cols, mask=mask, other=0.0).to(tl.float32)
        if LORA:
            slot = tl.load(idx_ptr + row).to(tl.int64)
            b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + cols[:, None] * stride_bo
            h_row = h_ptr + row * stride_hn
            g = (g + lora_gather.expand_block(h_row, b_rows, slot, mask, 1, 1, R, BLOCK, BLOCK_R)).to(dtype).to(
                tl.float32)
            u = (u + lora_gather.expand_block(h_row + R, b_rows + width * stride_bo, slot, mask, 1, 1, R, BLOCK,
                                              BLOCK_R)).to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        product = (act * u).to(dtype)
        tl.store(out_ptr + row * width + cols, product, mask=mask)
        if SHRINK:
            slot = tl.load(idx_ptr + row).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R2)
            r_mask = (offs_r < R2) & ((offs_r * 0 + slot) >= 0)  # the slot per element, as the shrink's
            a = tl.load(a_ptr + tl.maximum(slot, 0) * stride_as + offs_r[:, None] * stride_ar + cols[None, :],
                        mask=r_mask[:, None] & mask[None, :], other=0.0).to(tl.float32)
            partial = tl.sum(a * product.to(tl.float32)[None, :], axis=1)
            partials = part_ptr + (row * BLOCKS) * R2 + offs_r
            tl.store(partials + tl.program_id(1) * R2, partial, mask=offs_r < R2)
            ticket = tickets.take(ticket_ptr + row)
            last = (offs_r * 0 + ticket) == BLOCKS - 1
            total = tl.zeros([BLOCK_R2], dtype=tl.float32)
            for b in range(0, BLOCKS):  # block order, whichever program came last
                total += tl.load(partials + b * R2, mask=(offs_r < R2) & last, other=0.0, cache_modifier=".cg")
            tl.store(hd_ptr + row * R2 + offs_r, total, mask=(offs_r < R2) & last)
            tickets.hand_back(ticket_ptr + row, ticket, BLOCKS, BLOCK_R2)

    @triton.jit
    def _silu_mul_flat_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Elements ``[pid * BLOCK, ...)`` of two tensors: ``silu(gate)`` rounded, times ``up``, rounded."""
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        dtype = out_ptr.dtype.element_ty
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + at, (act * u).to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_grads(g, u, grad, dtype: tl.constexpr):
        """The product's gradient to both inputs (fp32 values), as autograd rounds it: ``up``'s is
        ``grad silu(g)`` (the SiLU rounded first); the gate's is ``(grad up)`` rounded, times SiLU's
        derivative ``s (1 + g (1 - s))`` in fp32, rounded."""
        sig = 1.0 / (1.0 + tl.exp(-g))
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        g_act = (grad * u).to(dtype).to(tl.float32)
        return (g_act * sig * (1.0 + g * (1.0 - sig))).to(dtype), (grad * act).to(dtype)

    @triton.jit
    def _silu_mul_backward_kernel(g_ptr, u_ptr, grad_ptr, gg_ptr, gu_ptr, n, BLOCK: tl.constexpr):
        """Elements ``[pid * BLOCK, ...)``: both inputs' gradients (:func:`_silu_mul_grads`)."""
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
        gg, gu = _silu_mul_grads(g, u, grad, gg_ptr.dtype.element_ty)
        tl.store(gg_ptr + at, gg, mask=mask)
        tl.store(gu_ptr + at, gu, mask=mask)

    @triton.jit
    def _silu_mul_packed_backward_kernel(y_ptr, grad_ptr, gy_ptr, width, BLOCK: tl.constexpr):
        """Columns ``[pid1 * BLOCK, ...)`` of one row of a packed (gate | up) input: both halves'
        gradients (:func:`_silu_mul_grads`) into the same columns of ``gy``'s halves."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        at = row * 2 * width + cols
        g = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + at + width, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        gg, gu = _silu_mul_grads(g, u, grad, gy_ptr.dtype.element_ty)
        tl.store(gy_ptr + at, gg, mask=mask)
        tl.store(gy_ptr + at + width, gu, mask=mask)
