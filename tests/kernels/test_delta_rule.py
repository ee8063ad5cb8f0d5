"""The fused gated-delta-rule decode step (interpreted on a CPU, compiled on a GPU) against the
torch step it replaces: outputs and the state it advances in place."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tinsmith.kernels import delta_rule as dr
from tinsmith.models.gated_deltanet import recurrent_gated_delta_step



def case(dtype, device, b=3, hk=2, hv=4, dk=16, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, hk, dk, generator=gen).to(device, dtype)
    k = torch.randn(b, 1, hk, dk, generator=gen).to(device, dtype)
    v = torch.randn(b, 1, hv, dv, generator=gen).to(device, dtype)
    g = -torch.rand(b, 1, hv, generator=gen).to(device)  # log-decay, fp32 as the layer computes it
    beta = torch.rand(b, 1, hv, generator=gen).to(device, dtype)
    state = torch.randn(b, hv, dk, dv, generator=gen).to(device)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(hk=1, hv=1, dk=16, dv=16), dict(hk=2, hv=4, dk=128, dv=128, b=2),
                                   dict(hk=4, hv=4, dk=40, dv=72)])
def test_fused_step_equals_the_torch_step(dtype, shape):
    device = kernel_device()
    q, k, v, g, beta, state = case(dtype, device, **shape)
    want_out, want_state = recurrent_gated_delta_step(q, k, v, g, beta, state.clone())
    got_state = state.clone()
    got_out = dr.decode_step_(q, k, v, g, beta, got_state)
    assert got_out.dtype == dtype and got_out.shape == want_out.shape
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=tol, atol=tol)


def test_rows_with_no_decay_and_no_write_keep_their_state_exactly():
    """A fixed-shape step's padding rows come with g = 0 and beta = 0: their state is untouched."""
    device = kernel_device()
    q, k, v, g, beta, state = case(torch.float32, device, b=4)
    g[2:], beta[2:] = 0.0, 0.0
    before = state.clone()
    dr.decode_step_(q, k, v, g, beta, state)
    assert torch.equal(state[2:], before[2:]) and not torch.equal(state[:2], before[:2])


def test_only_fp32_contiguous_states_take_the_kernel(monkeypatch):
    monkeypatch.setattr(dr, "BACKEND", "triton")
    state = torch.zeros(2, 4, 16, 8)
    assert dr.usable(state) == (dr.triton is not None)
    assert not dr.usable(state.to(torch.bfloat16))
    assert not dr.usable(state.transpose(-1, -2))
    monkeypatch.setattr(dr, "BACKEND", "auto")
    assert dr.usable(state) == (dr.triton is not None and state.is_cuda)


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import delta_rule as dr

target = GPUTarget("cuda", 90, 32)
fn = dr._step_kernel
for dt in sys.argv[1:]:
    types = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "g_ptr": "*fp32", "beta_ptr": f"*{dt}",
             "s_ptr": "*fp32", "o_ptr": f"*{dt}", "q_scale": "fp32", "eps": "fp32"}
    const = {"REP": 2, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "PDL": dt == "bf16"}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target).asm["cubin"]
'''


def test_kernel_compiles_for_hopper(tmp_path):
    """The interpreter does not compile: build the kernel for sm_90 (no GPU needed)."""
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16", "fp32")
