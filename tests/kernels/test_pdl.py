"""Programmatic dependent launch (tinsmith.kernels.pdl) where no GPU is: off for CPU tensors (the
kernels launch as before, which every interpreted kernel test runs), the probe kernel's arithmetic,
and the wait and signal instructions in the kernels built for sm_90."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import pdl


def test_off_for_cpu_tensors_and_when_switched_off(monkeypatch):
    x = torch.zeros(4)
    assert not pdl.active(x) and pdl.options(x) == {}
    monkeypatch.setattr(pdl, "ENABLED", "off")
    assert pdl.options(x) == {}


def test_this_triton_has_the_instructions():
    pytest.importorskip("triton")
    assert pdl.supported()


def test_probe_kernel_computes_in_stream_order():
    """The probe's launches, in two rounds (on a GPU: eager, then replayed from a graph), leave the
    value it checks for."""
    device = kernel_device()
    x = torch.ones(3000, dtype=torch.float32, device=device)
    for _ in range(2):
        for add in pdl.PROBE_ADDS:
            pdl._probe_kernel[(3,)](x, 3000, ADD=add, BLOCK=1024)
    assert pdl.probe_value(rounds=2) == 41.0  # (1*2+1)*2+3 = 9, then (9*2+1)*2+3 = 41
    assert bool((x == pdl.probe_value(rounds=2)).all())


_COMPILE = BUILD_PRELUDE + """
from tinsmith.kernels import kv_store, pdl, swiglu

for on in (False, True):
    build(pdl._probe_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"ADD": 1, "BLOCK": 1024, "PDL": on})
    build(kv_store._store_kernel, {"K_ptr": "*bf16", "V_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                                   "page_ptr": "*i64", "at_ptr": "*i64", "d": "i32",
                                   **{f"stride_{s}": "i64" for s in ("kn", "kh", "vn", "vh", "page", "head", "pos")}},
          {"BLOCK_D": 128, "PDL": on})
    build(swiglu._silu_mul_kernel, {"y_ptr": "*bf16", "out_ptr": "*bf16", "width": "i32", "stride_row": "i64",
                                    "h_ptr": "*fp32", "b_ptr": "*bf16", "idx_ptr": "*i64", "a_ptr": "*bf16",
                                    "part_ptr": "*fp32", "hd_ptr": "*fp32", "ticket_ptr": "*i32",
                                    **{f"stride_{s}": "i64" for s in ("hn", "bs", "bo", "as", "ar")}},
          {"BLOCK": 1024, "PDL": on})
"""


def test_kernels_wait_and_signal_when_built_with_pdl(tmp_path):
    """Built for sm_90, a kernel with ``PDL`` holds the grid-dependency wait and signal, one without
    neither (the other kernels' build tests check theirs the same way)."""
    assert_builds_for_hopper(_COMPILE, tmp_path)


def test_the_servers_option_reaches_every_process(monkeypatch):
    """``--no-dependent-launches``: the serving process switches them off where it configures its
    device, and tensor- and data-parallel ranks, which configure theirs, get the option with their
    runtime's arguments."""
    from tinsmith.parallel.serving import runtime_kwargs_of
    from tinsmith.worker.service import RuntimeOptions
    from tinsmith.worker.warm_up import configure_device

    monkeypatch.setattr(pdl, "ENABLED", "auto")
    configure_device(torch.device("cpu"), dependent_launches=False)
    assert pdl.ENABLED == "off"
    configure_device(torch.device("cpu"))
    assert pdl.ENABLED == "auto"
    assert runtime_kwargs_of(RuntimeOptions(dependent_launches=False))["dependent_launches"] is False


def test_a_kernel_failing_with_them_runs_again_without(monkeypatch):
    """A kernel that fails to build or launch dependent on the kernel before switches them off on
    its device and runs again as before; its family stays on the kernels, not on torch."""
    from tinsmith.kernels import guard as guard_module
    from tinsmith.kernels.guard import KernelGuard

    monkeypatch.setattr(guard_module, "triton_interpreting", lambda: False)  # the interpreter raises every failure
    monkeypatch.setattr(pdl, "_probed", {})
    monkeypatch.setattr(pdl, "active", lambda t: 0 not in pdl._probed)  # as on a GPU whose probe passed
    launches = []

    def kernel(x):
        launches.append(pdl.options(x))
        if launches[-1]:
            raise RuntimeError("this build cannot wait on the kernel before")
        return "ran"

    guard = KernelGuard("test kernels", "torch")
    x = torch.zeros(1)
    assert guard.call(kernel, x, on=x) == "ran"
    assert launches == [{"PDL": True, "launch_pdl": True}, {}]
    assert guard.failed is None and pdl._probed[0].startswith("a kernel failed with them (RuntimeError")
    assert guard.call(kernel, x, on=x) == "ran" and launches[-1] == {}  # off from then on

    def broken(x):
        raise RuntimeError("broken either way")

    assert guard.call(broken, x, on=x) is None and guard.failed.startswith("RuntimeError")  # torch from now on
