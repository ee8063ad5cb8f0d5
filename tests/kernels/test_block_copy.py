"""The block copy kernel writes every block (cast, and scaled) where torch's copy and multiply
put it, and nothing else; lists it cannot take go to torch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tinsmith.kernels import block_copy
from tinsmith.kernels.block_copy import BlockCopies, torch_copies


def _blocks(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, list, list, list]:
    """A block-diagonal stack's blocks (two parts of different heights, two rows of the stack),
    a separate contiguous tensor, their fp32 sources and scales (one block unscaled)."""
    g = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 40, 24, generator=g).to(device, dtype)  # (rows, out of both parts, 2 x rank 12)
    other = torch.randn(70, 16, generator=g).to(device, dtype)
    dst = [stack[0, :10, :12], stack[0, 10:, 12:], stack[2, :10, :8], stack[2, 10:, 12:20], other]
    src = [torch.randn(*d.shape, generator=g).to(device) * 3 for d in dst]
    return stack, [stack, other], dst, src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blocks_land_where_torch_puts_them(dtype, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(block_copy, "BACKEND", "triton")
    scales = [0.5, 2.0, None, 0.37, 1.5]
    _, got_buffers, got_dst, src = _blocks(device, dtype)
    _, want_buffers, want_dst, _ = _blocks(device, dtype)
    copies = BlockCopies(got_dst, src, scales)
    assert block_copy.usable(got_dst, src)
    for _ in range(2):  # the table is made once and reused
        copies.run()
    torch_copies(want_dst, src, scales)
    for got, want in zip(got_buffers, want_buffers):
        if dtype == torch.float32 or device == "cuda":  # torch's roundings exactly
            assert torch.equal(got, want)
        else:  # Triton's interpreter rounds to a 16-bit float its own way: within an ulp or two
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=0)
    # outside the blocks nothing moved
    stack, fresh = got_buffers[0], _blocks(device, dtype)[0]
    mask = torch.ones_like(stack, dtype=torch.bool)
    for d in got_dst[:4]:
        mask.view(-1)[torch.as_strided(torch.arange(stack.numel(), device=device), d.shape, d.stride(),
                                       d.storage_offset()).flatten()] = False
    assert torch.equal(stack[mask], fresh[mask])


def test_dispatch_follows_backend_and_takes_what_it_can(monkeypatch):
    dst, src = [torch.zeros(4, 8, dtype=torch.bfloat16)[:, :4]], [torch.zeros(4, 4)]
    monkeypatch.setattr(block_copy, "BACKEND", "torch")
    assert not block_copy.usable(dst, src)
    monkeypatch.setattr(block_copy, "BACKEND", "auto")
    assert not block_copy.usable(dst, src)  # CPU tensors: torch
    monkeypatch.setattr(block_copy, "BACKEND", "triton")
    assert block_copy.usable(dst, src) == (block_copy.triton is not None)
    assert not block_copy.usable(dst + [torch.zeros(4, 4, dtype=torch.float16)], src + [torch.zeros(4, 4)])  # two dtypes
    assert not block_copy.usable([torch.zeros(4, 8, dtype=torch.bfloat16)[:, ::2]], src)  # gaps along a row
    assert not block_copy.usable([], [])


def test_the_torch_path_copies_then_scales(monkeypatch):
    monkeypatch.setattr(block_copy, "BACKEND", "torch")
    buf = torch.zeros(2, 6, dtype=torch.bfloat16)
    src = [torch.full((2, 3), 1.3), torch.full((2, 3), 1.3)]
    BlockCopies([buf[:, :3], buf[:, 3:]], src, [3.0, None]).run()
    assert torch.equal(buf[:, :3], torch.full((2, 3), 1.3).to(torch.bfloat16) * 3.0)  # rounded, then scaled
    assert torch.equal(buf[:, 3:], torch.full((2, 3), 1.3).to(torch.bfloat16))


_COMPILE = '''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import block_copy

for dst in sys.argv[1:]:
    for scaled, block_r, block_c in ((True, 128, 32), (False, 16, 256)):
        src = ASTSource(fn=block_copy._block_copy_kernel, signature={"table_ptr": "*i64", "scale_ptr": "*fp32",
                        "SRC": "constexpr", "DST": "constexpr", "SCALED": "constexpr", "BLOCK_R": "constexpr",
                        "BLOCK_C": "constexpr"},
                        constexprs={"SRC": tl.float32, "DST": getattr(tl, dst), "SCALED": scaled,
                                    "BLOCK_R": block_r, "BLOCK_C": block_c})
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
'''


def test_kernel_compiles_for_hopper(tmp_path):
    assert_builds_for_hopper(_COMPILE, tmp_path, "bfloat16", "float16", "float32")
