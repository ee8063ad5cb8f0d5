"""Gathered LoRA ops: the torch path against a per-row float64 product, the Triton kernels
(interpreted on a CPU, compiled on a GPU) against the torch path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import tickets


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
    """d[i] = B[idx i] @ h[i] in float64, zero for idx -1 (the same product as the shrink's)."""
    return per_row_shrink(h, B_bank, idx)


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


def per_row_shrink(x, A_bank, idx):
    """h[i] = A[idx i] @ x[i] in float64, zero for idx -1."""
    h = torch.zeros(x.shape[0], A_bank.shape[1], dtype=torch.float64)
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            h[i] = A_bank[s].double() @ x[i].double()
    return h


def bank_case(dtype, device="cpu", n=11, k=200, ranks=(8, 3, 5), bank_rank=8, parts=1, outs=(70,), seed=5):
    """A bank as LoraBank lays it out: adapters of smaller rank zero-padded to the bank's, ``parts``
    projections stacked along the rank (A) and the outputs (B), rows of several slots and of none."""
    g = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    A = torch.zeros(slots, parts * bank_rank, k)
    B = torch.zeros(slots, sum(outs), bank_rank)
    for s, r in enumerate(ranks):
        for j in range(parts):
            A[s, j * bank_rank: j * bank_rank + r] = torch.randn(r, k, generator=g) / k**0.5
        B[s, :, :r] = torch.randn(sum(outs), r, generator=g)
    x = torch.randn(n, k, generator=g)
    idx = torch.tensor([0, -1, 2, 1, 1, -1, 2, 0, 0, 1, -1, 2][:n])
    columns, start = [], 0
    for o in outs:
        columns.append((start, start + o))
        start += o
    offsets = torch.cat([torch.full((b - a,), j * bank_rank, dtype=torch.int32) for j, (a, b) in enumerate(columns)])
    return (x.to(device, dtype), A.to(device, dtype), B.to(device, dtype), idx.to(device), columns,
            offsets.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2, 3, 7, None])
def test_split_k_partials_sum_to_the_shrink(dtype, split, monkeypatch):
    """Each partial is its own slice of the input's product (the last one short: 200 is no multiple
    of the 32-wide blocks); they add up to the shrink, zeros for rows of slot -1."""
    device = kernel_device()
    if device == "cpu":
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 32)  # the GPU's narrow blocks, many splits, in the interpreter
    x, A, _, idx, _, _ = bank_case(dtype, device)
    p = lg.shrink_partials_triton(x, A, idx, split)
    assert p.dtype == torch.float32 and p.shape[0] == x.shape[0] and p.shape[2] == A.shape[1]
    splits = p.shape[1]
    if split is not None and device == "cpu":
        assert splits == {1: 1, 2: 2, 3: 3, 7: 7}[split]  # 7 blocks of 32: 4+3, 3+3+1, one each
    k_split = -(-x.shape[1] // splits)
    k_split = -(-k_split // 32) * 32 if device == "cpu" else None
    xs, As, ids = x.cpu(), A.cpu(), idx.cpu()
    if k_split is not None:
        for s in range(splits):
            sl = slice(s * k_split, (s + 1) * k_split)
            torch.testing.assert_close(p[:, s].cpu().double(), per_row_shrink(xs[:, sl], As[:, :, sl], ids),
                                       rtol=1e-4, atol=1e-4)
    h_ref = per_row_shrink(xs, As, ids)
    torch.testing.assert_close(p.sum(1).cpu().double(), h_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lg.shrink_triton(x, A, idx, split).cpu().double(), h_ref, rtol=1e-4, atol=1e-4)
    assert not p[(idx < 0)].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 3, None])
def test_split_shrink_then_expand_equal_per_row_products(dtype, split, monkeypatch):
    """A split-K shrink and the expand into a column view of a wider output: the float64 per-row
    result, rows of slot -1 and the other columns untouched; adapters of rank 3 and 5 in a bank of
    rank 8."""
    device = kernel_device()
    if device == "cpu":
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 32)
    x, A, B, idx, _, _ = bank_case(dtype, device)
    out = B.shape[1]
    base = torch.randn(x.shape[0], 2 * out + 3).to(device, dtype)
    y = base.clone()
    h = lg.shrink_triton(x, A, idx, split)
    assert h.shape == (x.shape[0], A.shape[1]) and h.dtype == torch.float32
    lg.expand_triton(y[:, out: 2 * out], h, B, idx)
    _, d_ref = per_row(x.cpu(), A.cpu(), B.cpu(), idx.cpu())
    want = (base[:, out: 2 * out].double().cpu() + d_ref).to(dtype)
    torch.testing.assert_close(y[:, out: 2 * out].cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    assert torch.equal(y[:, :out], base[:, :out]) and torch.equal(y[:, 2 * out:], base[:, 2 * out:])
    assert torch.equal(y[idx < 0], base[idx < 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("outs", [(64, 24, 24), (40, 40), (1030, 130, 7)])
def test_split_shrink_then_expand_parts_equal_each_part_alone(dtype, split, outs, monkeypatch):
    """Packed projections: one split-K shrink over the stacked A, one expand reading each column's
    part (part boundaries inside output blocks, parts of odd widths, -1 rows, a padded rank)."""
    device = kernel_device()
    if device == "cpu":
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 32)
    x, A, B, idx, columns, offsets = bank_case(dtype, device, parts=len(outs), outs=outs)
    base = torch.randn(x.shape[0], B.shape[1]).to(device, dtype)
    y = base.clone()
    lg.expand_triton(y, lg.shrink_triton(x, A, idx, split), B, idx, offsets)
    want = (base.double().cpu() + per_part(x.cpu(), A.cpu(), B.cpu(), idx.cpu(), columns)).to(dtype)
    torch.testing.assert_close(y.cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    assert torch.equal(y[idx < 0], base[idx < 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("parts", [1, 3])
def test_the_last_program_adds_the_partials_in_split_order(dtype, split, parts, monkeypatch):
    """The summed shrink (one launch) equals the partials added in split order, bit for bit, and
    the same again on a second call: the tickets are back at zero after every call, those of
    every block of outputs (three parts of rank 32 are two blocks). More rows than there are
    tickets: torch adds the partials, the same values."""
    device = kernel_device()
    if device == "cpu":
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 32)
    x, A, _, idx, _, _ = bank_case(dtype, device, parts=parts, bank_rank=8 if parts == 1 else 32,
                                   outs=(70,) * parts)
    p = lg.shrink_partials_triton(x, A, idx, split)
    assert p.shape[1] == split or device != "cpu"
    in_order = p[:, 0].clone()
    for s in range(1, p.shape[1]):
        in_order += p[:, s]
    h = lg.shrink_triton(x, A, idx, split)
    assert torch.equal(h, in_order)
    assert lg._shrink_launch(x, A, idx, split, summed=True)[1] is not None  # the kernel added them
    assert not tickets.counters(x.device).any()
    assert torch.equal(lg.shrink_triton(x, A, idx, split), h)
    capacity = tickets.CAPACITY
    monkeypatch.setattr(tickets, "CAPACITY", x.shape[0] - 1)  # too few counters: the partials go to torch
    torch.testing.assert_close(lg.shrink_triton(x, A, idx, split), h, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(tickets, "CAPACITY", capacity)
    monkeypatch.setattr(lg, "SUM_IN_KERNEL", False)
    torch.testing.assert_close(lg.shrink_triton(x, A, idx, split), h, rtol=1e-6, atol=1e-6)


def test_split_depends_on_shapes_only(monkeypatch):
    """About SHRINK_PROGRAMS programs, whole K blocks, at most SHRINK_MAX_SPLIT; none once the rows
    fill the GPU; SHRINK_SPLIT overrides."""
    if not lg.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setattr(lg, "SHRINK_PROGRAMS", 512)
    monkeypatch.setattr(lg, "SHRINK_MAX_SPLIT", 8)
    assert lg.shrink_split(64, 32, 2048) == 8  # o_proj, 64 rows: 1 rank block, 16 K blocks of 128
    assert lg.shrink_split(64, 96, 2048) == 4  # q/k/v packed: 2 rank blocks of 64
    assert lg.shrink_split(256, 32, 6144) == 2
    assert lg.shrink_split(256, 96, 2048) == 1  # 512 programs already
    assert lg.shrink_split(4096, 32, 2048) == 1  # prefill-sized batches
    assert lg.shrink_split(64, 32, 200) == 2  # no more splits than K blocks
    monkeypatch.setattr(lg, "SHRINK_SPLIT", 1)
    assert lg.shrink_split(64, 32, 2048) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_with_split_shrink(backend, monkeypatch):
    """The layers' entry points (shrink, expand_parts) give the torch path's result either way,
    the shrink split in three on the kernel path."""
    x, A, B, idx, columns, offsets = bank_case(torch.float32, parts=2, outs=(40, 24))
    want = torch.zeros(x.shape[0], B.shape[1])
    lg.expand_parts_torch(want, lg.shrink_torch(x, A, idx), B, idx, columns)
    if backend == "triton":
        kernel_device()
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 64)
        monkeypatch.setattr(lg, "SHRINK_SPLIT", 3)
    monkeypatch.setattr(lg, "BACKEND", backend)
    monkeypatch.setattr(lg.GUARD, "failed", None)
    h = lg.shrink(x, A, idx)
    torch.testing.assert_close(h, lg.shrink_torch(x, A, idx), rtol=1e-5, atol=1e-5)
    y = torch.zeros_like(want)
    lg.expand_parts(y, h, B, idx, columns, offsets)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert lg.GUARD.failed is None


_COMPILE = BUILD_PRELUDE + """
from tinsmith.kernels import lora_gather as lg

for dt in sys.argv[1:]:
    pdl = dt == "bf16"  # bf16's with the dependent-launch wait (tinsmith.kernels.pdl)
    strides = {f"stride_{s}": "i32" for s in ("xn", "xk", "as", "ar", "ak", "on", "os", "or", "hn", "hr")}
    shrink = {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": "*fp32", "h_ptr": "*fp32",
              "ticket_ptr": "*i32", **strides}
    # one pass per row (split 1), 8 splits of 2 blocks (64 rows, K = 2048), 2 of 24 (256 rows, K = 6144),
    # the last two with their partials added up by the kernel and by torch
    for R, K, k_split, br, summed in ((40, 4096, 4096, 64, False), (32, 2048, 256, 32, True),
                                      (32, 2048, 256, 32, False), (96, 6144, 3072, 64, True)):
        build(lg._bgmv_shrink_kernel, shrink, {"R": R, "K": K, "K_SPLIT": k_split, "SPLITS": -(-K // k_split),
                                               "SUM": summed, "BLOCK_R": br, "BLOCK_K": 128, "PDL": pdl})
    strides = {f"stride_{s}": "i32" for s in ("hn", "hr", "bs", "bo", "br", "yn", "yo")}
    expand = {"h_ptr": "*fp32", "b_ptr": f"*{dt}", "idx_ptr": "*i64", "hoff_ptr": "*i32", "y_ptr": f"*{dt}", **strides}
    for O, R, seg in ((151936, 40, False), (4096, 32, True), (12288, 128, True)):
        build(lg._bgmv_expand_kernel, expand, {"O": O, "R": R, "SEGMENTED": seg, "BLOCK_O": 128,
                                               "BLOCK_R": min(64, triton.next_power_of_2(R)), "PDL": pdl})
"""

def test_triton_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernels for sm_90 (no GPU needed): the shrink
    in one pass per row and split, the expand plain and over packed projections."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
