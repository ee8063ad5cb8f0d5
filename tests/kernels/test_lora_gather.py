"""Gathered LoRA ops: the torch path against a per-row float64 product, the Triton kernels
(interpreted on a CPU, compiled on a GPU) against the torch path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tinsmith.kernels import lora_gather as lg


def per_row(x, A_bank, B_bank, idx):
    """y[i] = B[idx i] @ (A[idx i] @ x[i]) in float64, zero for idx -1 (and h as well)."""
    h = torch.zeros(x.shape[0], A_bank.shape[1], dtype=torch.float64)
    d = torch.zeros(x.shape[0], B_bank.shape[1], dtype=torch.float64)
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            h[i] = A_bank[s].double() @ x[i].double()
            d[i] = B_bank[s].double() @ h[i]
    return h, d


def case(dtype, device="cpu", n=7, k=96, r=12, slots=5, out=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(device, dtype)
    A = (torch.randn(slots, r, k, generator=g) / k**0.5).to(device, dtype)
    B = torch.randn(slots, out, r, generator=g).to(device, dtype)
    idx = torch.tensor([0, -1, 4, 2, 2, -1, 1, 3, 0][:n], device=device)
    return x, A, B, idx


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_equal_per_row_products(dtype):
    x, A, B, idx = case(dtype)
    h_ref, d_ref = per_row(x, A, B, idx)
    h = lg.shrink_torch(x, A, idx)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h.double(), h_ref, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    # expand adds into a column view of a wider output (a packed projection) and nothing else.
    base = torch.randn(x.shape[0], 3 * B.shape[1]).to(dtype)
    y = base.clone()
    cols = slice(B.shape[1], 2 * B.shape[1])
    lg.expand_torch(y[:, cols], h, B, idx)
    expected = base[:, cols].double() + d_ref
    torch.testing.assert_close(y[:, cols].double(), expected, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 40)
    assert torch.equal(y[:, : B.shape[1]], base[:, : B.shape[1]]) and torch.equal(y[:, 2 * B.shape[1]:], base[:, 2 * B.shape[1]:])
    assert torch.equal(y[1], base[1]) and torch.equal(y[5], base[5])  # rows with no adapter untouched



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [dict(n=7, k=96, r=12, slots=5, out=70), dict(n=9, k=2100, r=40, slots=6, out=1030)])
def test_triton_kernels_equal_torch_path(dtype, shape):
    """Ranks and sizes that are not powers of two nor block multiples, -1 rows, a column view."""
    device = kernel_device()
    x, A, B, idx = case(dtype, device, **shape)
    h = lg.shrink_triton(x, A, idx)
    h_ref, d_ref = per_row(x.cpu(), A.cpu(), B.cpu(), idx.cpu())
    # The kernels accumulate in fp32 from the stored inputs: compare with float64 products.
    torch.testing.assert_close(h.cpu().double(), h_ref, rtol=1e-4, atol=1e-4)
    out = B.shape[1]
    base = torch.randn(x.shape[0], 2 * out + 3).to(device, dtype)
    y = base.clone()
    lg.expand_triton(y[:, out: 2 * out], h, B, idx)
    want = (base[:, out: 2 * out].double().cpu() + per_row_expand(h.cpu(), B.cpu(), idx.cpu())).to(dtype)
    torch.testing.assert_close(y[:, out: 2 * out].cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(y[:, :out], base[:, :out]) and torch.equal(y[:, 2 * out:], base[:, 2 * out:])
    dead = (idx < 0).nonzero().squeeze(1)
    assert torch.equal(y[dead], base[dead])


def per_row_expand(h, B_bank, idx):
    d = torch.zeros(h.shape[0], B_bank.shape[1], dtype=torch.float64)
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            d[i] = B_bank[s].double() @ h[i].double()
    return d


def parts_case(dtype, device="cpu", n=9, k=80, r=10, slots=5, outs=(64, 24, 24), seed=3):
    """A packed bank of three projections (q/k/v-like): A stacked along the rank, B along the outputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(device, dtype)
    A = (torch.randn(slots, len(outs) * r, k, generator=g) / k**0.5).to(device, dtype)
    B = torch.randn(slots, sum(outs), r, generator=g).to(device, dtype)
    idx = torch.tensor([0, -1, 4, 2, 2, -1, 1, 3, 0][:n], device=device)
    columns, start = [], 0
    for o in outs:
        columns.append((start, start + o))
        start += o
    offsets = torch.cat([torch.full((b - a,), j * r, dtype=torch.int32) for j, (a, b) in enumerate(columns)])
    return x, A, B, idx, columns, offsets.to(device)


def per_part(x, A, B, idx, columns):
    """Each part on its own: its rank rows of A, its columns of B, in float64."""
    r = B.shape[2]
    out = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float64)
    for j, (a, b) in enumerate(columns):
        _, d = per_row(x, A[:, j * r:(j + 1) * r], B[:, a:b], idx)
        out[:, a:b] = d
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_parts_equals_each_part_alone(dtype):
    """One shrink over the stacked A and one expand into the packed output equal the per-part products."""
    x, A, B, idx, columns, offsets = parts_case(dtype)
    base = torch.randn(x.shape[0], B.shape[1]).to(dtype)
    y = base.clone()
    lg.expand_parts_torch(y, lg.shrink_torch(x, A, idx), B, idx, columns)
    want = base.double() + per_part(x, A, B, idx, columns)
    torch.testing.assert_close(y.double(), want, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 40)
    assert torch.equal(y[idx < 0], base[idx < 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outs", [(64, 24, 24), (40, 40), (1030, 130, 7)])
def test_triton_expand_parts_equals_torch_path(dtype, outs):
    """Part boundaries inside an output block, parts of odd widths, -1 rows."""
    device = kernel_device()
    x, A, B, idx, columns, offsets = parts_case(dtype, device, outs=outs)
    h = lg.shrink_triton(x, A, idx)
    base = torch.randn(x.shape[0], B.shape[1]).to(device, dtype)
    y, y_ref = base.clone(), base.clone()
    lg.expand_triton(y, h, B, idx, offsets)
    lg.expand_parts_torch(y_ref, h, B, idx, columns)
    torch.testing.assert_close(y.cpu().float(), y_ref.cpu().float(), rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_dispatch_follows_backend(monkeypatch):
    x = torch.zeros(2, 4)
    monkeypatch.setattr(lg, "BACKEND", "torch")
    assert not lg.triton_usable(x)
    monkeypatch.setattr(lg, "BACKEND", "auto")
    assert lg.triton_usable(x) == (lg.triton_available() and x.is_cuda)


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import lora_gather as lg

target = GPUTarget("cuda", 90, 32)
for dt in sys.argv[1:]:
    common = {"idx_ptr": "*i64", "voff_ptr": "*i32", "O": "constexpr", "K": "constexpr", "ACCUMULATE": "constexpr",
              "SEGMENTED": "constexpr", "BLOCK_O": "constexpr", "BLOCK_K": "constexpr",
              **{f"stride_{s}": "i32" for s in ("vn", "vk", "ms", "mo", "mk", "on", "oo")}}
    shrink = {"v_ptr": f"*{dt}", "m_ptr": f"*{dt}", "out_ptr": "*fp32", **common}
    expand = {"v_ptr": "*fp32", "m_ptr": f"*{dt}", "out_ptr": f"*{dt}", **common}
    fn = lg._bgmv_kernel
    for sig, const in ((shrink, {"O": 40, "K": 4096, "ACCUMULATE": False, "SEGMENTED": False, "BLOCK_O": 64, "BLOCK_K": 128}),
                       (expand, {"O": 151936, "K": 40, "ACCUMULATE": True, "SEGMENTED": False, "BLOCK_O": 128, "BLOCK_K": 64}),
                       (expand, {"O": 4096, "K": 32, "ACCUMULATE": True, "SEGMENTED": True, "BLOCK_O": 128, "BLOCK_K": 32})):
        sig = {name: sig[name] for name in fn.arg_names}
        assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["cubin"]
'''


def test_triton_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernels for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
