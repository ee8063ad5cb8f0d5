"""The decode attention kernels (interpreted on a CPU, compiled on a GPU) against the torch path:
SDPA over the rows' positions under a mask, and gpt-oss' eager sink attention."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device, skip_if_interpreter_cannot_loop_to_runtime_bounds
from tinsmith.kernels import decode_attention as da
from tinsmith.models.layers import eager_sink_attention

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}



def case(dtype, device, n=5, hq=8, hk=2, d=64, rows=7, capacity=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, 1, d, generator=g).to(device, dtype)
    K = torch.randn(rows, hk, capacity, d, generator=g).to(device, dtype)
    V = torch.randn(rows, hk, capacity, d, generator=g).to(device, dtype)
    return q, K, V


def reference(q, K, V, n_keys, span, sinks=None):
    """What the cache's torch path computes: every row over ``span`` positions, those past its keys masked."""
    n = q.shape[0]
    allowed = (torch.arange(span, device=q.device)[None, :] < n_keys[:, None])[:, None]  # (n, 1, span)
    q32, K32, V32 = q.float(), K[:n, :, :span].float(), V[:n, :, :span].float()
    if sinks is not None:
        return eager_sink_attention(q32, K32, V32, allowed, sinks.float())
    return torch.nn.functional.scaled_dot_product_attention(q32, K32, V32, attn_mask=allowed[:, None],
                                                            enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_kernels_equal_masked_attention(dtype, splits):
    """Rows of different lengths (one key, a block boundary, the whole span), split or not."""
    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(dtype, device)
    span = 150
    n_keys = torch.tensor([1, 64, 65, 150, 97], device=device)
    got = da.decode_attention(q, K, V, n_keys, span, splits=splits)
    want = reference(q, K, V, n_keys, span)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("rep,d", [(1, 32), (3, 80), (16, 128)])
def test_grouped_heads_and_head_sizes(rep, d):
    """Query heads per K/V head from 1 (no grouping) past a block of 16, head sizes off a power of two."""
    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(torch.float32, device, n=3, hq=2 * rep, hk=2, d=d, rows=3, capacity=70)
    n_keys = torch.tensor([70, 33, 5], device=device)
    got = da.decode_attention(q, K, V, n_keys, 70, splits=2)
    torch.testing.assert_close(got, reference(q, K, V, n_keys, 70), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_sinks_join_every_denominator(splits):
    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(torch.float32, device, n=4, hq=4, hk=2, d=32, rows=4, capacity=130)
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0], device=device)
    n_keys = torch.tensor([1, 128, 40, 129], device=device)
    got = da.decode_attention(q, K, V, n_keys, 130, sinks=sinks, splits=splits)
    torch.testing.assert_close(got, reference(q, K, V, n_keys, 130, sinks), rtol=2e-5, atol=2e-5)
    plain = da.decode_attention(q, K, V, n_keys, 130, splits=splits)
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks took their share


@pytest.mark.parametrize("sinks", [False, True])
def test_the_last_split_combines_as_the_combine_kernel(sinks, monkeypatch):
    """The splits combined by their last program (one launch) and by the combine kernel: the same
    output to rounding (their sums run in another order), rows whose later splits saw no key
    among them; the counters back at zero; too many rows for the counters: the combine kernel."""
    from tinsmith.kernels import tickets

    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(torch.float32, device, n=4, hq=4, hk=2, d=32, rows=4, capacity=200)
    sink = torch.tensor([0.5, -1.0, 3.0, 2.0], device=device) if sinks else None
    n_keys = torch.tensor([1, 200, 70, 129], device=device)
    got = da.decode_attention(q, K, V, n_keys, 200, sinks=sink, splits=4)
    assert not tickets.counters(q.device).any()
    monkeypatch.setattr(da, "COMBINE_IN_SPLITS", False)
    kernel = da.decode_attention(q, K, V, n_keys, 200, sinks=sink, splits=4)
    torch.testing.assert_close(got, kernel, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, reference(q, K, V, n_keys, 200, sink), rtol=2e-5, atol=2e-5)
    monkeypatch.setattr(da, "COMBINE_IN_SPLITS", True)
    monkeypatch.setattr(tickets, "CAPACITY", 4 * 2 - 1)
    torch.testing.assert_close(da.decode_attention(q, K, V, n_keys, 200, sinks=sink, splits=4), kernel,
                               rtol=0, atol=0)


def test_strided_cache_views():
    """The cache hands over views (its rows past ``n``, its capacity past ``span``) and q with its
    query length of one: strides other than the contiguous ones must be honoured."""
    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(torch.float32, device, n=2, hq=4, hk=2, d=32, rows=6, capacity=96)
    Kt = K.transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost in memory
    n_keys = torch.tensor([96, 17], device=device)
    got = da.decode_attention(q, Kt, V, n_keys, 96, splits=2)
    torch.testing.assert_close(got, reference(q, K, V, n_keys, 96), rtol=2e-5, atol=2e-5)


def paged(K, pages_per_row, page=64, seed=0):
    """K (rows, heads, positions, d) laid out in a pool of pages, each row's pages scattered: (pool, table)."""
    rows, heads, positions, d = K.shape
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(rows * pages_per_row, generator=g) + 1  # page 0 stays unused
    pool = torch.full((rows * pages_per_row + 1, heads, page, d), float("nan"), dtype=K.dtype, device=K.device)
    table = order.view(rows, pages_per_row).to(torch.int32).to(K.device)
    padded = torch.nn.functional.pad(K, (0, 0, 0, pages_per_row * page - positions))
    pool[table.long().flatten()] = padded.view(rows, heads, pages_per_row, page, d).transpose(1, 2).flatten(0, 1)
    return pool, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_pools_equal_row_buffers(dtype, splits):
    """Pages of 64 positions scattered over a pool (what the paged cache holds) read as the rows'
    own buffers; positions past a row's keys (NaN here) are never read."""
    device = kernel_device()
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    q, K, V = case(dtype, device, n=5, rows=5, capacity=200)
    span = 200
    n_keys = torch.tensor([1, 64, 65, 200, 129], device=device)
    Kp, table = paged(K, 4)
    Vp, _ = paged(V, 4)  # the same seed: the same pages as K's
    got = da.decode_attention(q, Kp, Vp, n_keys, span, splits=splits, table=table)
    want = reference(q, K, V, n_keys, span)
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_split_plan_covers_the_span_in_whole_blocks():
    for rows, heads, span in [(1, 8, 4096), (64, 8, 384), (256, 2, 64), (3, 4, 1)]:
        splits, per = da.split_plan(rows, heads, span, 32, torch.device("cpu"))
        assert per % 32 == 0 and splits * per >= span and (splits - 1) * per < span and 1 <= splits <= da.MAX_SPLITS


def test_dispatch_follows_backend(monkeypatch):
    q = torch.zeros(1, 2, 1, 8)
    monkeypatch.setattr(da, "BACKEND", "torch")
    assert not da.usable(q)
    monkeypatch.setattr(da, "BACKEND", "auto")
    assert da.usable(q) == (da.triton_available() and q.is_cuda)


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import decode_attention as da

target = GPUTarget("cuda", 90, 32)
strides = ("qn", "qh", "kn", "kh", "kp", "vn", "vh", "vp", "tn", "pn", "ph", "ps", "ln", "lh", "on", "oh")
for dt in sys.argv[1:]:
    types = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "len_ptr": "*i64", "table_ptr": "*i32",
             "part_ptr": "*fp32",
             "lse_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": f"*{dt}", "ticket_ptr": "*i32", "scale": "fp32",
             "split_len": "i32",
             "splits": "i32", **{f"stride_{s}": "i32" for s in strides}}
    precision = "ieee" if dt == "fp32" else "tf32"
    for fn, const in ((da._split_kernel, {"REP": 2, "D": 128, "BLOCK_H": 16, "BLOCK_D": 128, "BLOCK_N": 32,
                                          "PRECISION": precision, "PAGE": 0, "DIRECT": False, "SINKS": False,
                                          "COMBINE": False}),
                      (da._split_kernel, {"REP": 8, "D": 64, "BLOCK_H": 16, "BLOCK_D": 64, "BLOCK_N": 32,
                                          "PRECISION": precision, "PAGE": 64, "DIRECT": False, "SINKS": False,
                                          "COMBINE": True}),
                      (da._split_kernel, {"REP": 8, "D": 64, "BLOCK_H": 16, "BLOCK_D": 64, "BLOCK_N": 32,
                                          "PRECISION": precision, "PAGE": 0, "DIRECT": False, "SINKS": True,
                                          "COMBINE": True}),
                      (da._split_kernel, {"REP": 2, "D": 128, "BLOCK_H": 16, "BLOCK_D": 128, "BLOCK_N": 32,
                                          "PRECISION": precision, "PAGE": 64, "DIRECT": True, "SINKS": False,
                                          "COMBINE": False}),
                      (da._split_kernel, {"REP": 8, "D": 64, "BLOCK_H": 16, "BLOCK_D": 64, "BLOCK_N": 32,
                                          "PRECISION": precision, "PAGE": 0, "DIRECT": True, "SINKS": True,
                                          "COMBINE": False}),
                      (da._combine_kernel, {"D": 128, "BLOCK_D": 128, "BLOCK_S": 16, "SINKS": True})):
        const = {**const, "PDL": dt == "bf16"}  # bf16's with the dependent-launch wait (tinsmith.kernels.pdl)
        sig = {name: "constexpr" if name in const else types[name] for name in fn.arg_names}
        assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["cubin"]
'''


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernels for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
