"""What the kernel tests share: where the kernels run (a GPU, or Triton's interpreter on a CPU),
and building them for sm_90 without a GPU, in a process of its own (the test process may have
Triton in interpreter mode, which does not compile)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinsmith.kernels.lora_gather import triton_available, triton_interpreting


def kernel_device(runtime_loop_bounds: bool = False) -> str:
    """"cuda" where there is a GPU, "cpu" where Triton interprets; skips the test otherwise, and
    where the kernels under test loop to a bound known only at run time (``runtime_loop_bounds``)
    that this Triton's interpreter cannot run (:func:`skip_if_interpreter_cannot_loop_to_runtime_bounds`)."""
    if runtime_loop_bounds:
        skip_if_interpreter_cannot_loop_to_runtime_bounds()
    if not triton_available():
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]' or '[test]')")
    if torch.cuda.is_available():
        return "cuda"
    if not triton_interpreting():
        pytest.skip("no GPU and TRITON_INTERPRET=1 was not set before triton was imported")
    return "cpu"


def skip_if_interpreter_cannot_loop_to_runtime_bounds() -> None:
    """Triton's interpreter before 3.7 cannot run a loop whose bound is known only at run time, an
    argument or a loaded value (it takes ``int()`` of a 1-element array, which NumPy 2 refuses:
    decode attention's key loop, the loss's vocabulary loop, the norms' backward over vectors);
    compiled kernels can, on every version."""
    if triton_available() and triton_interpreting():
        import triton

        if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop to a bound known only at run time (3.7 can)")


# What a build script (for :func:`assert_builds_for_hopper`) starts with: ``build(fn, sig, const)``
# compiles kernel ``fn`` for sm_90 with the given argument types (names the kernel lacks are
# ignored) and constexpr values (arguments in neither are constexprs left to their defaults), and
# checks that the dependent-launch instructions are there exactly when ``const`` has ``PDL`` on
# (tinsmith.kernels.pdl).
BUILD_PRELUDE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

target = GPUTarget("cuda", 90, 32)


def build(fn, sig, const):
    sig = {name: sig.get(name, "constexpr") for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target)
    assert kernel.asm["cubin"]
    ptx = kernel.asm["ptx"]
    if const.get("PDL"):
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, fn.__name__
    else:
        assert "griddepcontrol" not in ptx, fn.__name__
"""


def assert_builds_for_hopper(script: str, tmp_path: Path, *args: str) -> None:
    """Run ``script`` (it calls ``triton.compile`` for a ``GPUTarget("cuda", 90, 32)``) with ``args``
    and fail with its error output unless it exits cleanly."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]' or '[test]')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
