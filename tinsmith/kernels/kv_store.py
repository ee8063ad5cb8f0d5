"""A decode step's new keys and values written into the K/V page pools as one kernel.

Each attention layer of a decode step stores every row's new key and value at that row's page
and offset: in torch two ``index_put_`` kernels (the keys, then the values), about 56 of a
28-layer step's kernels, each at decode sizes mostly launch and tail. :func:`store` writes both
in one: one program per (row, key/value head) copies the two ``d``-vectors.

Where the cache's ``store_target`` offers a layer's pools, the kernel that turns the layer's q/k
heads writes them instead (:func:`tinsmith.kernels.rms_norm.rms_norm`'s ``store`` after their
norm, Qwen3; :func:`tinsmith.kernels.rms_norm.turn`'s for the rotary alone, Llama): one launch
less again. This kernel writes the rest (rotary other than full-width, a layer that declines),
and its :func:`usable` decides for both.

Inference only, CUDA tensors (or, in tests, Triton's interpreter); the torch writes stay the CPU
path and the reference.
"""

from __future__ import annotations

import torch

from tinsmith.kernels import pdl
from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernel for CUDA tensors, torch for the rest; "torch"; "triton": the kernel for every
# tensor (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("K/V store kernel", "storing keys and values in torch")


def usable(k: torch.Tensor, K: torch.Tensor) -> bool:
    """Whether :func:`store` takes the kernel for new keys like ``k`` (n, heads, d) into pools like ``K``."""
    if triton is None or not GUARD.allows(BACKEND, k):
        return False
    return k.stride(-1) == 1 and K.is_contiguous() and k.dtype == K.dtype


def store(K: torch.Tensor, V: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: torch.Tensor,
          at: torch.Tensor) -> bool:
    """``K[page, :, at] = k`` and ``V[page, :, at] = v`` in one kernel; False when the kernel failed
    here (the caller writes in torch). ``K``/``V`` (pages, heads, page size, d) contiguous pools,
    ``k``/``v`` (n, heads, d) with unit stride in ``d``, ``page``/``at`` (n,) integer tensors."""
    n, heads, d = k.shape
    if n == 0:
        return True
    return GUARD.call(_launch, K, V, k, v, page, at, on=k) is not None


def _launch(K: torch.Tensor, V: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: torch.Tensor,
            at: torch.Tensor) -> bool:
    n, heads, d = k.shape
    block = triton.next_power_of_2(d)
    _store_kernel[(n, heads)](K, V, k, v, page, at, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              K.stride(0), K.stride(1), K.stride(2), BLOCK_D=block, num_warps=1, **pdl.options(k))
    return True


if triton is not None:

    @triton.jit
    def _store_kernel(K_ptr, V_ptr, k_ptr, v_ptr, page_ptr, at_ptr, d, stride_kn, stride_kh, stride_vn, stride_vh,
                      stride_page, stride_head, stride_pos, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """Row ``pid0``'s head ``pid1``: its key and value at (its page, the head, its offset)."""
        pdl.wait(PDL)  # first: see tinsmith.kernels.pdl
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        page = tl.load(page_ptr + row).to(tl.int64)
        at = tl.load(at_ptr + row).to(tl.int64)
        dest = page * stride_page + head * stride_head + at * stride_pos + cols
        key = tl.load(k_ptr + row * stride_kn + head * stride_kh + cols, mask=mask)
        value = tl.load(v_ptr + row * stride_vn + head * stride_vh + cols, mask=mask)
        tl.store(K_ptr + dest, key, mask=mask)
        tl.store(V_ptr + dest, value, mask=mask)
