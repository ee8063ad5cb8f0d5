"""A kernel that cannot run on a machine is switched off once, with a warning naming why; the
torch path serves from then on. CUDA faults and failures under Triton's interpreter are raised."""

from __future__ import annotations

import logging

import pytest
import torch

from tinsmith.kernels import guard as guard_mod
from tinsmith.kernels.guard import KernelGuard


def test_a_failing_kernel_is_switched_off_once(monkeypatch, caplog):
    monkeypatch.setattr(guard_mod, "triton_interpreting", lambda: False)
    g = KernelGuard("test kernels", "using torch")
    calls = []

    def broken(x):
        calls.append(x)
        raise RuntimeError("PTX assembly aborted")

    with caplog.at_level(logging.WARNING):
        assert g.call(broken, 1, on=torch.zeros(1)) is None
        assert g.call(broken, 2, on=torch.zeros(1)) is None
    assert calls == [1] and "PTX assembly aborted" in g.failed
    assert sum("test kernels cannot run here" in r.message for r in caplog.records) == 1
    assert KernelGuard("ok", "").call(lambda x: x + 1, 1, on=torch.zeros(1)) == 2
    # a kernel that writes in place and returns nothing: whether it ran
    out = torch.zeros(1)
    assert KernelGuard("ok", "").ran(out.add_, 1.0, on=out) is True and out.item() == 1.0
    assert g.ran(out.add_, 1.0, on=out) is False and out.item() == 1.0  # switched off: not run


@pytest.mark.parametrize("interpreting, error", [(True, RuntimeError), (False, type("AcceleratorError", (Exception,), {}))])
def test_faults_and_interpreter_failures_are_raised(monkeypatch, interpreting, error):
    monkeypatch.setattr(guard_mod, "triton_interpreting", lambda: interpreting)
    g = KernelGuard("test kernels", "using torch")

    def broken():
        raise error("illegal memory access")

    with pytest.raises(error):
        g.call(broken, on=torch.zeros(1))
    assert g.failed is None


def test_switched_off_kernels_are_not_usable(monkeypatch):
    from tinsmith.kernels import decode_attention as da
    from tinsmith.kernels import delta_rule as dr

    monkeypatch.setattr(da, "BACKEND", "triton")
    monkeypatch.setattr(dr, "BACKEND", "triton")
    if da.triton is None:
        pytest.skip("triton is not installed")
    assert da.usable(torch.zeros(1)) and dr.usable(torch.zeros(1, 1, 2, 2))
    monkeypatch.setattr(da.GUARD, "failed", "RuntimeError: x")
    monkeypatch.setattr(dr.GUARD, "failed", "RuntimeError: x")
    assert not da.usable(torch.zeros(1)) and not dr.usable(torch.zeros(1, 1, 2, 2))


def test_gathered_lora_kernels_that_cannot_run_fall_back_to_torch(monkeypatch):
    """The multi-adapter decode kernels (shrink, expand) are guarded like the others: a build or
    launch failure switches them off once and the torch gathers give the same result."""
    from tinsmith.kernels import lora_gather as lg

    if lg.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(guard_mod, "triton_interpreting", lambda: False)
    monkeypatch.setattr(lg, "BACKEND", "triton")
    monkeypatch.setattr(lg.GUARD, "failed", None)

    def broken(*args):
        raise RuntimeError("PTX assembly aborted")

    monkeypatch.setattr(lg, "shrink_triton", broken)
    monkeypatch.setattr(lg, "expand_triton", broken)
    g = torch.Generator().manual_seed(0)
    x, A, B = torch.randn(5, 16, generator=g), torch.randn(3, 4, 16, generator=g), torch.randn(3, 24, 4, generator=g)
    idx = torch.tensor([0, 2, -1, 1, 2])
    h = lg.shrink(x, A, idx)
    assert "PTX assembly aborted" in lg.GUARD.failed and not lg.triton_usable(x)
    torch.testing.assert_close(h, lg.shrink_torch(x, A, idx))
    y, want = torch.zeros(5, 24), torch.zeros(5, 24)
    lg.expand(y, h, B, idx)
    lg.expand_torch(want, h, B, idx)
    torch.testing.assert_close(y, want)


def test_a_family_switch_allows_cuda_tensors_on_auto_any_on_triton_none_once_failed():
    guard, cpu = KernelGuard("test kernels", "torch"), torch.zeros(1)
    assert not guard.allows("auto", cpu) and guard.allows("triton", cpu) and not guard.allows("torch", cpu)
    guard.failed = "it broke"
    assert not guard.allows("triton", cpu)
