"""Fixtures of the GPU tier: the real server on ``--device cuda``, driven by the real SDK.

The whole folder is skipped, with the reason shown, when CUDA is not available. Set
``TINSMITH_GPU_TEST_DEVICE=cpu`` to run the same tests on the CPU (fp32 tolerances): that
checks the tier's own logic on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
import torch

from tests.conftest import SMALL
from tests.e2e.server import ServerProcess
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.server.config import ServerConfig

DEVICE = os.environ.get("TINSMITH_GPU_TEST_DEVICE", "cuda")
HAS_DTYPE_OPTION = "dtype" in ServerConfig.model_fields  # ``--dtype`` (fp32 mode on a GPU)


@dataclass(frozen=True)
class Tolerance:
    """How far the server's numbers may sit from an fp32 CPU reference of the same weights."""

    logprob_rel: float  # ||ours - ref|| / ||ref|| over all positions of a batch
    logprob_abs: float  # largest single-position difference


# bf16 weights-and-activations on a GPU: ~1e-3..1e-2 relative (see docs/gpu.md); fp32 is exact to rounding.
BF16 = Tolerance(logprob_rel=3e-2, logprob_abs=0.25)
FP32 = Tolerance(logprob_rel=1e-4, logprob_abs=1e-3)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    reason = None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        reason = (f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                  "the GPU tier runs only on a GPU machine (scripts/gpu-check)")
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tolerance() -> Tolerance:
    return FP32 if DEVICE == "cpu" else BF16


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny random base models (Qwen3 and Llama), stored in bf16 so every device reads the same weights."""
    root = tmp_path_factory.mktemp("gpu-models")
    return (make_tiny_model(root / "qwen3", "qwen3", SMALL, seed=1, dtype="bfloat16"),
            make_tiny_model(root / "llama", "llama", SMALL, seed=2, dtype="bfloat16"))


@pytest.fixture(scope="session")
def base_model(gpu_models) -> str:
    return str(gpu_models[0])


@pytest.fixture(scope="session")
def second_base_model(gpu_models) -> str:
    return str(gpu_models[1])


@pytest.fixture(scope="session")
def make_gpu_server(gpu_models, tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory of servers on ``DEVICE`` serving both tiny models; all stopped at the end."""
    made: list[ServerProcess] = []

    def make(extra_args: list[str] = ()) -> ServerProcess:
        s = ServerProcess(gpu_models[0], tmp_path_factory.mktemp("gpu-data"),
                          extra_args=["--base-model", str(gpu_models[1]), "--device", DEVICE, *extra_args])
        made.append(s)
        return s.start(timeout=180)

    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="session")
def gpu_server(make_gpu_server) -> ServerProcess:
    return make_gpu_server()


@pytest.fixture
def sc(gpu_server) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=gpu_server.base_url, api_key="tml-gpu-tier")
    yield client
    try:
        client.close("success").result(timeout=60)
    except Exception:  # noqa: BLE001 - already closed, or the session is gone
        pass
