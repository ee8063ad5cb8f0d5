"""Sharded checkpoint writes of a full fine-tune, run on each data-parallel rank.

They live in an importable module (not a test file) because the rank processes import them.
"""

from __future__ import annotations

import resource
import signal
from pathlib import Path

import torch

from tests.parallel.fsdp_scenario import build_full_runtime
from tests.parallel.scenario import make_data
from tinsmith.checkpoints.export import save_hf_model
from tinsmith.checkpoints.state_format import load_training_state, state_header
from tinsmith.errors import CapacityError
from tinsmith.parallel.group import TPGroup
from tinsmith.types import AdamParams, ForwardBackwardInput
from tinsmith.worker.runtime import FULL_UNIT, TrainRequest

HEADER = state_header("tiny", None, 1, {"type": "adamw"})


def train_one_step(rt, seed: int = 0) -> None:
    """One training call and one AdamW step, so the state holds optimizer moments."""
    data = make_data(seed, [9, 5, 13], rt.config.vocab_size)
    (res,) = rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(data, "cross_entropy"))])
    if isinstance(res, Exception):
        raise res
    rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-2))


def save_rank_main(dp: TPGroup, model_dir: str, out: str, one_process_state: str) -> dict:
    """Each rank: a step, then a sharded training-state save and a sharded Hugging Face export;
    the same state gathered whole (the all-gather path) and the export written by rank 0 alone,
    for comparison. Then the one-process checkpoint ``one_process_state`` is loaded into the
    group, and the state the group then holds is returned."""
    rt = build_full_runtime(model_dir, dp)
    train_one_step(rt)
    result: dict = {}
    result["size"] = rt.save_state_sharded(FULL_UNIT, str(Path(out) / "state"), HEADER, "state")
    result["state_peak"] = rt.last_save_peak_bytes
    result["state_bytes"] = rt.state_bytes()
    weights, opt = rt.export_full_state(FULL_UNIT)  # every rank gathers everything
    result["gathered"] = (weights, opt)
    result["hf_size"] = rt.save_hf_sharded(str(Path(out) / "hf"), model_dir, (), "hf")
    result["hf_peak"] = rt.last_save_peak_bytes
    result["weights_bytes"] = rt.weights_bytes()
    whole = rt.export_weights()
    if dp.rank == 0:
        save_hf_model(Path(out) / "hf_one_writer", whole, Path(model_dir))
    train_one_step(rt, seed=1)  # moves away from the saved state, which loading must bring back
    back = load_training_state(Path(out) / "state", with_optimizer=True)
    rt.import_full_state(FULL_UNIT, back.weights, back.optimizer)
    result["reloaded"] = rt.export_full_state(FULL_UNIT)
    one = load_training_state(Path(one_process_state), with_optimizer=True)
    rt.import_full_state(FULL_UNIT, one.weights, one.optimizer)
    result["loaded_one_process"] = rt.export_full_state(FULL_UNIT)
    return result


def failing_rank_main(dp: TPGroup, model_dir: str, out: str) -> dict:
    """Rank 1 may write files of at most 1000 bytes (a disk too small for its part): the save
    fails on both ranks; the run then trains on, and a save with room commits."""
    rt = build_full_runtime(model_dir, dp)
    train_one_step(rt)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dp.rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))
    result: dict = {}
    try:
        rt.save_state_sharded(FULL_UNIT, str(Path(out) / "state"), HEADER, "tinker://run/weights/state")
        result["error"] = None
    except Exception as exc:
        result["error"] = (type(exc).__name__, str(exc))
    try:
        rt.save_hf_sharded(str(Path(out) / "hf"), model_dir, (), "tinker://run/weights/hf")
        result["hf_error"] = None
    except Exception as exc:
        result["hf_error"] = (type(exc).__name__, str(exc))
    result["left"] = sorted(p.name for p in Path(out).iterdir())
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    train_one_step(rt, seed=1)  # the group is still in step
    rt.save_state_sharded(FULL_UNIT, str(Path(out) / "state"), HEADER, "state")
    result["after"] = rt.export_full_state(FULL_UNIT)
    return result


def assert_bit_identical(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(ref) == sorted(got), where
    for name, t in ref.items():
        assert t.dtype == got[name].dtype and torch.equal(t, got[name]), f"{where}: {name}"


__all__ = ["CapacityError", "assert_bit_identical", "failing_rank_main", "save_rank_main"]
