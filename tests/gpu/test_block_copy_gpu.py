"""On the GPU: the block copy kernel (several tenants' strided stack blocks, refreshed after each
optimizer step) rounds as torch's copy and multiply do, bit for bit, so a refresh writes what a
rebuild of the stacks writes (tests/kernels/test_block_copy.py checks it in Triton's interpreter,
which rounds to 16-bit floats its own way)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.worker.test_joint_steps import HPS, _backward, _runtime
from tinsmith.kernels import block_copy
from tinsmith.kernels.block_copy import BlockCopies, torch_copies

pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("the block copy kernel runs on CUDA tensors")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocks_round_as_torch_does(dtype):
    _cuda()
    g = torch.Generator().manual_seed(0)
    got, want = (torch.randn(4, 6144, 96, generator=g).to(DEVICE, dtype) for _ in range(2))
    want.copy_(got)
    src = [torch.randn(n, 32, generator=g).to(DEVICE) * 5 for n in (2048, 1024, 1024, 6144)]
    at = [(0, 0, 2048, 0), (1, 2048, 3072, 32), (3, 3072, 4096, 64), (2, 0, 6144, 32)]
    scales = [0.5, 2.0, 0.37, None]
    copies = BlockCopies([got[i, a:b, c:c + 32] for i, a, b, c in at], src, scales)
    assert block_copy.usable(copies.dst, copies.src)
    copies.run()
    torch_copies([want[i, a:b, c:c + 32] for i, a, b, c in at], src, scales)
    assert block_copy.GUARD.failed is None
    assert torch.equal(got, want)


def test_several_tenants_stacks_after_steps_equal_the_torch_paths(qwen3_dir, monkeypatch):
    _cuda()
    stacks = {}
    for backend in ("torch", "auto"):
        monkeypatch.setattr(block_copy, "BACKEND", backend)
        rt, units = _runtime(qwen3_dir, torch.bfloat16, device=DEVICE)
        for step in range(3):
            _backward(rt, units, step)
            rt.optim_steps(list(zip(units, HPS)))
        stacks[backend] = [(m._tenant_stack.A.clone(), m._tenant_stack.B.clone()) for m in rt.model.modules()
                           if getattr(m, "_tenant_stack", None) is not None]
    assert stacks["torch"] and len(stacks["torch"]) == len(stacks["auto"])
    assert block_copy.GUARD.failed is None
    for (a, b), (c, d) in zip(stacks["torch"], stacks["auto"]):
        assert torch.equal(a, c) and torch.equal(b, d)
