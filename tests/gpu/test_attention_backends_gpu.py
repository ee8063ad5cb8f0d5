"""Masked attention with grouped-query heads takes a fused SDPA kernel on the GPU, not the math
fallback (which keeps a heads x Lq x Lk probability matrix per layer for backward): gpt-oss's
sinks and sliding windows in training and prefill, and any grouped-query model's prompt over a
cached prefix. With only the fused backends allowed, the call must still run, forward and
backward, and equal the math backend's result at bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tinsmith.models.layers import masked_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("sinks", [False, True], ids=["mask", "mask+sinks"])
def test_masked_grouped_attention_runs_on_a_fused_kernel(sinks):
    if DEVICE != "cuda":
        pytest.skip("SDPA's fused kernels are CUDA's")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
               for shape in ((2, 64, 512, 64), (2, 8, 1024, 64), (2, 8, 1024, 64)))
    i = torch.arange(1024, device=DEVICE)
    allowed = ((i[None, :] <= i[512:, None]) & (i[None, :] > i[512:, None] - 128))[None]  # a window, after a prefix
    s = torch.randn(64, device=DEVICE, generator=g) if sinks else None
    results = []
    for backends in ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], [SDPBackend.MATH]):
        with sdpa_kernel(backends):
            out = masked_attention(q, k, v, allowed, s)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        results.append((out.float(), [x.float() for x in grads]))
    (fused, fused_grads), (math, math_grads) = results
    torch.testing.assert_close(fused, math, rtol=2e-2, atol=2e-2)
    for a, b in zip(fused_grads, math_grads):
        assert (a - b).norm() <= 3e-2 * b.norm()
