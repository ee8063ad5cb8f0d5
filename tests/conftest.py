"""Shared fixtures: tiny HF checkpoints made on the spot (nothing is downloaded)."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels (tinsmith/kernels) are checked in Triton's interpreter, which is
# chosen when triton is first imported; the kernels still run only where a test asks for them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402

# Small enough for fast reference checks, with GQA (4 query heads over 2 kv heads).
SMALL = TinyShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """family -> directory of a tiny random checkpoint of that family."""
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(root / f, f, SMALL, seed=1) for f in ("qwen3", "llama", "qwen2")}


@pytest.fixture(scope="session")
def qwen3_dir(model_dirs):
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def tied_qwen3_dir(tmp_path_factory):
    shape = TinyShape(**{**SMALL.__dict__, "tie_word_embeddings": True})
    return make_tiny_model(tmp_path_factory.mktemp("tied") / "qwen3", "qwen3", shape, seed=2)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE: 4 experts, top-2, every layer routed."""
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", SMALL, seed=1)


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory):
    """A tiny gpt-oss: 4 experts, top-2, sinks, a 16-token window on layer 0 (full attention on layer 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss", "gpt_oss", SMALL, seed=1)


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory):
    """A tiny Qwen3.5: layer 0 Gated DeltaNet (2 key heads, 4 value heads), layer 1 gated attention."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "qwen3_5", "qwen3_5", SMALL, seed=1)


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory):
    """A tiny Qwen3.5-MoE: the layers of ``qwen3_5_dir``, 4 experts (top-2) and a shared expert each."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe") / "qwen3_5_moe", "qwen3_5_moe", SMALL, seed=1)


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    """A tiny Qwen3-VL: the decoder with M-RoPE and DeepStack, and a vision tower."""
    return make_tiny_model(tmp_path_factory.mktemp("vl") / "qwen3_vl", "qwen3_vl", SMALL, seed=3)


# Image-text Qwen3.5: head_dim 32, so its partial rotary (a quarter) has four frequencies, one for
# each multimodal axis and a second temporal one.
QWEN3_5_VL = TinyShape(**{**SMALL.__dict__, "head_dim": 32})


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory):
    """A tiny image-text Qwen3.5 as released (``Qwen3_5ForConditionalGeneration``): the hybrid decoder
    with multimodal RoPE in its attention layers, and a vision tower without DeepStack."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_vl") / "qwen3_5_vl", "qwen3_5_vl", QWEN3_5_VL, seed=4)


@pytest.fixture(scope="session")
def qwen3_5_moe_vl_dir(tmp_path_factory):
    """A tiny image-text Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``)."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe_vl") / "qwen3_5_moe_vl", "qwen3_5_moe_vl", QWEN3_5_VL,
                           seed=5)


@pytest.fixture(autouse=True)
def _threads_left_alone():
    """A test (or a benchmark's ``main`` it calls) that changes torch's thread count for the rest of
    the run makes later tests slower and their float sums differ from a run of them alone."""
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, f"the test left torch at {torch.get_num_threads()} threads (was {threads})"


# ``scripts/test`` runs the suite on several worker processes (pytest-xdist, ``-n auto``): most of
# its time is spent waiting on servers it started, so two workers on a 2-core machine take about
# half the time of one. This decides how many.
MAX_TEST_WORKERS = 4
_SERIAL_MARKS = re.compile(r"(?<!not )\b(slow|gpu)\b")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto``: ``TINSMITH_TEST_WORKERS`` if set, else one per CPU up to
    :data:`MAX_TEST_WORKERS`; none (one process) for the slow and GPU tiers, whose tests time
    things or share one device, and for runs of named files or tests, where starting workers
    costs more than it saves."""
    chosen = os.environ.get("TINSMITH_TEST_WORKERS")
    if chosen:
        if not chosen.isdigit():
            raise pytest.UsageError(f"TINSMITH_TEST_WORKERS must be a count of workers (0: one process), got {chosen!r}")
        return int(chosen)
    if _SERIAL_MARKS.search(config.getoption("markexpr") or ""):
        return 0
    if any(".py" in arg for arg in config.args):
        return 0
    return max(1, min(MAX_TEST_WORKERS, len(os.sched_getaffinity(0))))
