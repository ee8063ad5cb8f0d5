"""Segmented LoRA ops (rows of one adapter per tile): the tile tables, and the Triton kernels
(interpreted on a CPU, compiled on a GPU) against the gathered ops' torch path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tests.kernels.test_lora_gather import TOL, bank_case, parts_case, per_part, per_row_expand, per_row_shrink
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import tickets
from tinsmith.kernels import lora_segments as ls


def test_tiles_hold_each_adapters_rows_in_blocks():
    positions = [2, -1, 0, 2, 2, 0, -1, 2, 2]
    order, slot, first, count = ls.tile_table(positions, block=2)
    assert sorted(order.tolist()) == list(range(len(positions)))
    seen = []
    for s, a, c in zip(slot.tolist(), first.tolist(), count.tolist()):
        rows = order[a:a + c].tolist()
        assert 1 <= c <= 2 and all(positions[r] == s for r in rows)
        seen += rows
    assert sorted(seen) == list(range(len(positions)))
    assert slot.tolist() == [-1, 0, 2, 2, 2]  # none, adapter 0, adapter 2's five rows in three tiles
    assert ls.tiles_needed(positions, 2) == 5
    padded = ls.tile_table(positions, block=2, tiles=8)
    assert padded[1].tolist()[5:] == [-1] * 3 and padded[3].tolist()[5:] == [0] * 3  # unused tiles: no rows
    with pytest.raises(ValueError):
        ls.tile_table(positions, block=2, tiles=4)


def _tiles(idx: torch.Tensor, device, tiles: int | None = None) -> ls.RowTiles:
    return ls.row_tiles(idx.tolist(), torch.device(device), tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [dict(n=11, k=200), dict(n=37, k=2100)])
def test_segmented_kernels_equal_the_gathered_torch_path(dtype, shape, monkeypatch):
    """Adapters of smaller rank padded in the bank, rows of no adapter, more rows of one adapter
    than a tile holds, a column view, padding tiles; the shrink split several ways."""
    device = kernel_device()
    if device == "cpu":
        monkeypatch.setattr(lg, "CPU_MAX_BLOCK", 64)  # narrow blocks: several splits in the interpreter
    x, A, B, _, _, _ = bank_case(dtype, device, k=shape["k"], n=12)
    n = shape["n"]
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, x.shape[1], generator=g).to(device, dtype)
    idx = torch.randint(-1, A.shape[0], (n,), generator=g).to(device)
    tiles = _tiles(idx, device, tiles=ls.tiles_needed(idx.tolist()) + 2)
    h_ref = per_row_shrink(x.cpu(), A.cpu(), idx.cpu())  # the kernels sum fp32 products of the inputs
    for split in (1, 3, None):
        h = ls.shrink(x, A, tiles, split)
        assert h.dtype == torch.float32
        torch.testing.assert_close(h.cpu().double(), h_ref, rtol=1e-4, atol=1e-4)
    assert not h[idx < 0].any()
    assert torch.equal(ls.shrink(x, A, tiles), h)  # the same sums in the same order
    partials, summed = ls._shrink_launch(x, A, tiles, 3, summed=True)
    if partials.shape[1] > 1:  # the last program of each tile added its partials, in split order
        in_order = partials[:, 0].clone()
        for s in range(1, partials.shape[1]):
            in_order += partials[:, s]
        assert summed is not None and torch.equal(summed, in_order)
        assert not tickets.counters(x.device).any()
    out = B.shape[1]
    base = torch.randn(n, out + 5, generator=g).to(device, dtype)
    y = base.clone()
    ls.expand(y[:, 3:3 + out], h, B, tiles)
    want = (base[:, 3:3 + out].double().cpu() + per_row_expand(h.cpu(), B.cpu(), idx.cpu())).to(dtype)
    torch.testing.assert_close(y[:, 3:3 + out].cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(y[idx < 0], base[idx < 0]) and torch.equal(y[:, :3], base[:, :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outs", [(64, 32, 32), (48, 48)])
def test_segmented_expand_over_packed_parts(dtype, outs):
    device = kernel_device()
    x, A, B, idx, columns, offsets = parts_case(dtype, device, outs=outs, n=9)
    tiles = _tiles(idx, device)
    h = ls.shrink(x, A, tiles)
    block = ls.expand_block(B.shape[1], columns, device == "cpu")
    assert block is not None and all(a % block == 0 for a, _ in columns)
    base = torch.randn(x.shape[0], B.shape[1]).to(device, dtype)
    y = base.clone()
    ls.expand(y, h, B, tiles, offsets, block)
    want = (base.double().cpu() + per_part(x.cpu(), A.cpu(), B.cpu(), idx.cpu(), columns)).to(dtype)
    torch.testing.assert_close(y.cpu(), want, rtol=TOL[dtype] * 2, atol=TOL[dtype] * 8)


def test_parts_off_the_blocks_have_no_segmented_expand():
    assert ls.expand_block(1167, [(0, 1030), (1030, 1160), (1160, 1167)]) is None
    assert ls.expand_block(4096, [(0, 2048), (2048, 3072), (3072, 4096)]) == 128
    assert ls.expand_block(12288, [(0, 6144), (6144, 12288)]) == 128
    assert ls.expand_block(96, [(0, 48), (48, 96)]) == 16


_COMPILE = BUILD_PRELUDE + """
from tinsmith.kernels import lora_segments as ls

tables = {name: "*i32" for name in ("order_ptr", "slot_ptr", "first_ptr", "count_ptr")}
for dt in sys.argv[1:]:
    strides = {f"stride_{s}": "i32" for s in ("xn", "xk", "as", "ar", "ak", "on", "os", "or", "hn", "hr")}
    shrink = {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "out_ptr": "*fp32", "h_ptr": "*fp32", "ticket_ptr": "*i32",
              **tables, **strides}
    widen, precision = dt == "bf16", "tf32" if dt == "bf16" else "ieee"
    for R, K, k_split, br, summed in ((96, 2048, 256, 64, True), (32, 6144, 768, 32, False)):
        build(ls._sgmv_shrink_kernel, shrink, {"R": R, "K": K, "K_SPLIT": k_split, "SPLITS": K // k_split,
                                               "SUM": summed, "WIDEN": widen, "PRECISION": precision,
                                               "BLOCK_M": 16, "BLOCK_R": br, "BLOCK_K": 128, "PDL": widen})
    strides = {f"stride_{s}": "i32" for s in ("hn", "hr", "bs", "bo", "br", "yn", "yo")}
    expand = {"h_ptr": "*fp32", "b_ptr": f"*{dt}", "hoff_ptr": "*i32", "y_ptr": f"*{dt}", **tables, **strides}
    for O, R, seg in ((2048, 32, False), (4096, 32, True), (12288, 64, True)):
        build(ls._sgmv_expand_kernel, expand, {"O": O, "R": R, "SEGMENTED": seg, "BLOCK_M": 16, "BLOCK_O": 128,
                                               "BLOCK_R": min(64, triton.next_power_of_2(R)), "PDL": widen})
"""

def test_segmented_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build both kernels for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
