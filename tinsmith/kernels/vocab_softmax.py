"""The training loss's passes over a chunk of logits as two kernels that read them in bf16.

A training step's losses read ``log p(target | position)`` through
:mod:`tinsmith.models.chunked_logprobs`: each chunk of rows' logits is made by the unembedding's
GEMM, then, in torch, cast to fp32, reduced to its log-sum-exp, shifted, and in the backward made
again, cast, shifted, exponentiated, scaled and cast back for the next GEMMs: about ten passes
over ``rows x vocabulary`` entries, most of them in fp32. On an H200 (Qwen3-1.7B shape, 8 x 1024
tokens, 151,936 entries) those passes were about 20 ms of a 186 ms LoRA step. Here:

- :func:`row_logsumexp`: one program per row reads its half-precision logits once, keeping a
  running maximum and sum in fp32 (the log-sum-exp of the fp32 values torch would have made);
- :func:`softmax_grad_`: the logits' gradient ``-g_row * softmax + g`` at each row's target, in
  fp32, written over the logits in their own dtype (the next GEMMs' input), one read and one
  write. It takes one target per row (the losses' usual case: one next token per position);
  several per row (distillation's top-k) keep the torch path.

fp32 logits (a model in fp32) and CPUs keep the torch path, which is also the reference in tests
(CPU tensors run the kernels under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from tinsmith.kernels.guard import KernelGuard
from tinsmith.kernels.lora_gather import triton  # None without Triton (optional: 'tinsmith[gpu]')

if triton is not None:
    import triton.language as tl

# "auto": the kernels for half-precision CUDA logits, torch for the rest; "torch"; "triton": the
# kernels for any half-precision logits (CPU ones need TRITON_INTERPRET=1: tests).
BACKEND = "auto"
GUARD = KernelGuard("loss's softmax kernels", "computing the loss's softmax in torch")
BLOCK = 4096  # vocabulary entries a program reads at once


def usable(like: torch.Tensor) -> bool:
    """Whether the kernels take logits of ``like``'s dtype and device."""
    return triton is not None and GUARD.allows(BACKEND, like) and like.dtype in (torch.bfloat16, torch.float16)


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor | None:
    """fp32 ``logsumexp(logits.float(), -1)`` of (rows, vocabulary) half-precision ``logits``
    (unit stride along the vocabulary); None when the kernel failed here (the caller takes torch)."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    done = GUARD.call(_launch_lse, logits, lse, on=logits)
    return None if done is None else lse


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, g_row: torch.Tensor, target: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``-g_row[r] * exp(logits[r] - lse[r])``, plus ``g_row[r]`` at column ``target[r]`` (-1:
    none), computed in fp32 and written into ``out`` (default: over ``logits``) in the logits'
    dtype. ``g_row`` fp32 (rows,); ``target`` int32/int64 (rows,). None when the kernel failed."""
    out = logits if out is None else out
    done = GUARD.call(_launch_grad, logits, lse, g_row, target, out, on=logits)
    return None if done is None else out


def _launch_lse(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _lse_kernel[(rows,)](logits, lse, vocab, logits.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return lse


def _launch_grad(logits, lse, g_row, target, out) -> torch.Tensor:
    rows, vocab = logits.shape
    block = min(BLOCK, triton.next_power_of_2(vocab))
    grid = (rows, triton.cdiv(vocab, block))
    _grad_kernel[grid](logits, lse, g_row, target, out, vocab, logits.stride(0), out.stride(0), BLOCK=block,
                       num_warps=8 if block >= 2048 else 4)
    return out


if triton is not None:

    @triton.jit
    def _lse_kernel(logits_ptr, lse_ptr, vocab, stride_row, BLOCK: tl.constexpr):
        """One row: a running maximum and a sum rescaled to it, block by block."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        tl.store(lse_ptr + row, m + tl.log(s))

    @triton.jit
    def _grad_kernel(logits_ptr, lse_ptr, g_ptr, target_ptr, out_ptr, vocab, stride_row, stride_out,
                     BLOCK: tl.constexpr):
        """One block of one row's vocabulary: softmax times the row's gradient, its target's added."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        target = tl.load(target_ptr + row)
        d = tl.exp(x - lse) * -g
        d = tl.where(cols == target, d + g, d)
        tl.store(out_ptr + row * stride_out + cols, d.to(out_ptr.dtype.element_ty), mask=mask)
