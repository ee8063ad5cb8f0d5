"""Half-precision training: fp32 master weights for full fine-tunes, exact resume, fp32 logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tests.worker.helpers import sft_datum

VOCAB = 512
STEPS, LR = 20, 1e-6


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [sft_datum(rng, 24, VOCAB) for _ in range(3)]


def _fb(rt, unit, data, forward_only=False):
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", {}, forward_only))])
    if isinstance(res, Exception):
        raise res
    return res


def _full_runtime(model_dir, dtype: torch.dtype, master_weights: bool = True) -> TrainingRuntime:
    """A full fine-tune of ``model_dir`` in ``dtype``, starting from the bf16-rounded weights
    whatever ``dtype`` is, so every run starts from the very same values."""
    model = load_model(str(model_dir), dtype=torch.float32).model
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = model.to(dtype)
    return TrainingRuntime(model, full_finetune=True, master_weights=master_weights)


def _train(rt: TrainingRuntime, steps: int, data) -> None:
    for _ in range(steps):
        _fb(rt, 0, data)
        rt.optim_step(0, AdamParams(learning_rate=LR))


def _weights(rt: TrainingRuntime) -> dict[str, torch.Tensor]:
    """What training holds: the fp32 masters when kept, else the model's own weights (as fp32)."""
    return {n: p.detach().float().clone() for n, p in rt.unit(0).named_stepped}


def _relative_error(got: dict, want: dict, start: dict) -> float:
    """|| (got - start) - (want - start) || / || want - start ||, over all weights together."""
    num = sum(float(((got[n] - start[n]) - (want[n] - start[n])).norm() ** 2) for n in want)
    den = sum(float((want[n] - start[n]).norm() ** 2) for n in want)
    return (num / den) ** 0.5


def test_bf16_full_finetune_with_master_weights_tracks_fp32_and_without_them_stalls(qwen3_dir):
    data = _data()
    ref = _full_runtime(qwen3_dir, torch.float32)
    start = _weights(ref)
    _train(ref, STEPS, data)
    want = _weights(ref)

    master = _full_runtime(qwen3_dir, torch.bfloat16)
    assert master.unit(0).masters is not None and all(m.dtype == torch.float32 for m in master.unit(0).masters)
    assert all(p.dtype == torch.bfloat16 for p in master.unit(0).model_params)  # compute stays bf16
    _train(master, STEPS, data)
    got = _weights(master)

    plain = _full_runtime(qwen3_dir, torch.bfloat16, master_weights=False)
    assert plain.unit(0).masters is None
    _fb(plain, 0, data)
    assert all(p.grad is not None for p in plain.unit(0).params)  # it does get gradients...
    plain.optim_step(0, AdamParams(learning_rate=LR))
    _train(plain, STEPS - 1, data)  # ...but its updates round away
    stalled = _weights(plain)

    with_masters = _relative_error(got, want, start)
    without = _relative_error(stalled, want, start)
    print(f"relative error of the update vs fp32: with masters {with_masters:.4f}, without {without:.4f}")
    assert with_masters < 0.25, f"bf16 + fp32 masters strays from fp32 by {with_masters:.3f}"
    assert without > 0.9, f"bf16 without masters unexpectedly tracks fp32 ({without:.3f})"
    moved = sum(int((stalled[n] != start[n]).sum()) for n in start) / sum(t.numel() for t in start.values())
    moved_ref = sum(int((want[n] != start[n]).sum()) for n in start) / sum(t.numel() for t in start.values())
    assert moved_ref > 0.5 and moved < 0.2 * moved_ref  # updates below half a bf16 step round away
    # The model computes with the masters rounded to bf16 after every step.
    for (n, p), m in zip(master.unit(0).named_params, master.unit(0).masters):
        assert torch.equal(p.detach(), m.to(torch.bfloat16)), n


def test_bf16_full_finetune_resumes_exactly_from_saved_state(qwen3_dir):
    data, later = _data(1), _data(2)
    a = _full_runtime(qwen3_dir, torch.bfloat16)
    _train(a, 3, data)
    weights, opt = a.unit(0).export_state()
    assert all(t.dtype == torch.float32 for t in weights.values())  # the masters, not bf16 copies
    _train(a, 3, later)

    b = _full_runtime(qwen3_dir, torch.bfloat16)
    b.unit(0).import_state(weights, opt)
    _train(b, 3, later)
    for (n, pa), (_, pb) in zip(a.unit(0).named_stepped, b.unit(0).named_stepped):
        assert torch.equal(pa, pb), n
    for (n, pa), (_, pb) in zip(a.unit(0).named_params, b.unit(0).named_params):
        assert torch.equal(pa, pb), n


def test_gradients_accumulate_in_fp32_across_passes(qwen3_dir):
    """Two forward_backward calls before a step add their gradients in fp32 on the masters."""
    data = _data(3)
    rt = _full_runtime(qwen3_dir, torch.bfloat16)
    _fb(rt, 0, data[:1])
    first = [None if m.grad is None else m.grad.clone() for m in rt.unit(0).masters]
    assert all(p.grad is None for p in rt.unit(0).model_params)  # moved to the masters at once
    _fb(rt, 0, data[1:2])
    for m, g in zip(rt.unit(0).masters, first):
        assert m.grad is not None and m.grad.dtype == torch.float32
        assert g is not None and not torch.equal(m.grad, g)


def test_bf16_logprobs_are_fp32_and_close_to_an_fp32_run(qwen3_dir):
    data = _data(4)
    lp = {}
    for dtype in (torch.float32, torch.bfloat16):
        rt = TrainingRuntime(load_model(str(qwen3_dir), dtype=dtype).model, max_lora_adapters=2)
        u = rt.create_adapter(LoraSpec(rank=4, seed=0))
        res = _fb(rt, u, data)
        lp[dtype] = np.concatenate([o["logprobs"] for o in res.outputs])
    ref, half = lp[torch.float32], lp[torch.bfloat16]
    assert half.dtype == np.float32 and np.isfinite(half).all()
    assert not np.array_equal(ref, half)  # bf16 really ran
    np.testing.assert_allclose(half, ref, rtol=0.02, atol=0.05)


def test_bf16_full_finetune_resumes_exactly_through_a_saved_checkpoint(qwen3_dir, tmp_path):
    """The worker's save_state/load_state path on disk: fp32 masters written, read, continued."""
    from tinsmith.checkpoints.state_format import load_training_state, save_training_state
    from tinsmith.worker.service import RuntimeOptions, Worker

    worker = Worker(RuntimeOptions(dtype="bfloat16"))
    worker.add_base_model("m", str(qwen3_dir))
    assert next(worker.bases["m"].loaded.model.parameters()).dtype == torch.bfloat16
    data, later = _data(5), _data(6)

    def train(model_id: str, batches) -> None:
        rt = worker.placement(model_id).runtime
        for batch in batches:
            _fb(rt, 0, batch)
            worker.optim_step(model_id, AdamParams(learning_rate=1e-5))

    worker.create_model("a", "m", None)
    train("a", [data, data])
    save_training_state(tmp_path / "ckpt", worker.export_training_state("a"))
    train("a", [later, data])
    want = worker.export_training_state("a")
    worker.unload_model("a")

    worker.load_training_state("b", "m", load_training_state(tmp_path / "ckpt", with_optimizer=True), create=True)
    assert worker.steps("b") == 2
    train("b", [later, data])
    got = worker.export_training_state("b")
    assert got.weights.keys() == want.weights.keys() and got.optimizer.keys() == want.optimizer.keys()
    for n in want.weights:
        assert want.weights[n].dtype == torch.float32 and torch.equal(got.weights[n], want.weights[n]), n
    for n in want.optimizer:
        assert torch.equal(got.optimizer[n], want.optimizer[n]), n
