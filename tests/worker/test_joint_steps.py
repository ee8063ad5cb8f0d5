"""Several tenants' optimizer steps taken together (TrainingRuntime.optim_steps), and one unit's
step by the same kernel calls (TrainingRuntime.optim_step), leave each one exactly where its
torch optimizer's own ``step()`` would: weights, optimizer state and what the model computes
with, bit for bit, over steps that create the optimizer state and steps that read it; with
different hyperparameters, clipping, torch's foreach or fused AdamW, fp32 or bf16 compute; while
one unit's refusal or missing gradients stay its own result."""

from __future__ import annotations

import pytest
import torch

from bench.gpu.train import batch
from tinsmith.errors import InvalidInputError, NotFoundError
from tinsmith.models.loading import load_model
from tinsmith.optim import families
from tinsmith.types import AdamParams, DimuonParams, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

SPECS = [LoraSpec(rank=8, seed=1), LoraSpec(rank=4, seed=2, train_unembed=False), LoraSpec(rank=8, seed=3),
         LoraSpec(rank=2, seed=4, train_mlp=False)]
# Different rates and betas, clipping that bites (0.05) and one that does not (1e3), weight decay.
HPS = [AdamParams(learning_rate=1e-3, grad_clip_norm=0.05), AdamParams(learning_rate=2e-3, beta1=0.8),
       AdamParams(learning_rate=1e-3, grad_clip_norm=0.05), AdamParams(learning_rate=5e-4, weight_decay=0.1,
                                                                        grad_clip_norm=1e3)]


def _runtime(model_dir, dtype, adapters: int = 8, optimizers=None, device: str = "cpu") -> tuple[TrainingRuntime, list[int]]:
    model = load_model(str(model_dir), device=torch.device(device), dtype=dtype).model
    rt = TrainingRuntime(model, max_lora_adapters=adapters, max_lora_rank=8)
    optimizers = optimizers or ["adamw"] * len(SPECS)
    return rt, [rt.create_adapter(s, o) for s, o in zip(SPECS, optimizers)]


def torch_step(rt: TrainingRuntime, unit: int, hp) -> dict[str, float]:
    """The unit's step by its torch optimizer's own ``step()`` (:meth:`Trainable.step`): the
    reference the runtime's steps are held to."""
    hp.validate()
    if rt.unit(unit).slot is not None:
        rt.ensure_resident({unit})
    return rt.unit(unit).step(hp)


def _backward(rt: TrainingRuntime, units: list[int], step: int) -> None:
    vocab = rt.config.vocab_size
    res = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(batch(vocab, 2, 12, seed=10 * step + i), "cross_entropy"))
                               for i, u in enumerate(units)])
    assert not any(isinstance(r, Exception) for r in res), res


def _forward(rt: TrainingRuntime, unit: int) -> torch.Tensor:
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(batch(rt.config.vocab_size, 2, 12, seed=99),
                                                                          "cross_entropy", forward_only=True))])
    return torch.cat([torch.as_tensor(o["logprobs"]) for o in res.outputs])


def _assert_identical(a: TrainingRuntime, ua: int, b: TrainingRuntime, ub: int, where: str) -> None:
    wa, oa = a.unit(ua).export_state()
    wb, ob = b.unit(ub).export_state()
    assert sorted(wa) == sorted(wb) and sorted(oa) == sorted(ob), where
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{where}: {k}"
    for k in oa:
        assert torch.equal(oa[k], ob[k]), f"{where}: {k}"
    assert a.unit(ua).steps == b.unit(ub).steps, where
    assert torch.equal(_forward(a, ua), _forward(b, ub)), f"{where}: logprobs"


@pytest.mark.parametrize("dtype,fused", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16-fused"])
def test_joint_steps_equal_steps_alone_bit_for_bit(qwen3_dir, monkeypatch, dtype, fused):
    if fused:  # torch's fused AdamW, as CUDA parameters take it (it runs on CPUs too)
        monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    assert_joint_equals_alone(qwen3_dir, dtype, fused)


def assert_joint_equals_alone(model_dir, dtype, fused: bool, device: str = "cpu") -> None:
    """Two equal runtimes of four adapters train alike; one steps them one by one, the other
    together; after three steps every adapter is the same bit for bit (also run on a GPU)."""
    alone, ua = _runtime(model_dir, dtype, device=device)
    joint, uj = _runtime(model_dir, dtype, device=device)
    assert families.steps_on_device(alone.unit(ua[0]).optimizer) == fused
    for step in range(3):  # the first creates the optimizer state, the next read it
        _backward(alone, ua, step)
        _backward(joint, uj, step)
        expected = [torch_step(alone, u, hp) for u, hp in zip(ua, HPS)]
        got = joint.optim_steps(list(zip(uj, HPS)))
        assert got == expected, (got, expected)
    assert expected[0]["grad_norm"] > 0.05 and expected[3]["grad_norm"] < 1e3  # clipped, and not
    for i, (a, b) in enumerate(zip(ua, uj)):
        _assert_identical(alone, a, joint, b, f"unit {i}")


def test_a_refused_or_idle_unit_is_its_own_result(qwen3_dir):
    """Wrong hyperparameters, non-finite gradients, no gradients, an unknown unit, a Dimuon run
    (steps alone, in order): each gets what its step alone gives; the rest step as usual."""
    kinds = ["adamw", "adamw", "dimuon", "adamw"]
    alone, ua = _runtime(qwen3_dir, torch.float32, optimizers=kinds)
    joint, uj = _runtime(qwen3_dir, torch.float32, optimizers=kinds)
    for rt, units in ((alone, ua), (joint, uj)):
        _backward(rt, units[:3], 0)  # the last unit has no gradients
        p = rt.unit(units[1]).params[0]
        p.grad[0, 0] = float("nan")
    hps = [DimuonParams(learning_rate=1e-3), HPS[1], DimuonParams(learning_rate=1e-2), HPS[3]]

    def one(rt, u, hp):
        try:
            return torch_step(rt, u, hp)
        except Exception as exc:  # noqa: BLE001
            return exc

    expected = [one(alone, u, hp) for u, hp in zip(ua, hps)]
    got = joint.optim_steps(list(zip(uj, hps)) + [(12345, HPS[0])])
    assert isinstance(got[0], InvalidInputError) and "optimizer_params" in str(got[0])
    assert isinstance(got[1], InvalidInputError) and "NaN or infinity" in str(got[1])
    assert got[2] == expected[2] and got[2]["grad_norm"] > 0  # Dimuon, alone
    assert got[3] == expected[3] == {"grad_norm": 0.0, "skipped_no_grad": 1.0}
    assert isinstance(got[4], NotFoundError)
    assert [type(e) for e in expected[:2]] == [type(e) for e in got[:2]]
    for i, (a, b) in enumerate(zip(ua, uj)):
        _assert_identical(alone, a, joint, b, f"unit {i}")
    assert joint.unit(uj[0]).steps == 0 and joint.unit(uj[1]).steps == 0  # nothing applied


def test_a_failed_device_or_group_fails_the_call_not_one_unit(qwen3_dir, monkeypatch):
    """A unit that steps alone (Dimuon) and fails its own way is its own result; one whose step
    meets a failed device or a dead peer of its process group fails the whole call, as the engine
    must see it, instead of the other units meeting it in turn."""
    from tinsmith.parallel.group import ParallelError
    from tinsmith.worker.trainables import Trainable

    rt, units = _runtime(qwen3_dir, torch.float32, optimizers=["adamw", "dimuon", "adamw", "adamw"])
    _backward(rt, units, 0)
    hps = [HPS[0], DimuonParams(learning_rate=1e-2), HPS[2], HPS[3]]
    real = Trainable.step

    def failing(error):
        def step(self, hp):
            if self.optimizer_type == "dimuon":
                raise error
            return real(self, hp)
        return step

    monkeypatch.setattr(Trainable, "step", failing(RuntimeError("this unit's own trouble")))
    got = rt.optim_steps(list(zip(units, hps)))
    assert isinstance(got[1], RuntimeError) and [type(g) for g in got[::2]] == [dict, dict]
    for error in (ParallelError("all_reduce failed on rank 0 of 2"), RuntimeError("CUDA error: an illegal memory access")):
        monkeypatch.setattr(Trainable, "step", failing(error))
        with pytest.raises(type(error)):
            rt.optim_steps(list(zip(units, hps)))


def test_more_units_than_resident_slots_step_in_turns(qwen3_dir):
    """With room for two adapters, four step two at a time (the others parked meanwhile), and
    the results are still those of each step alone."""
    alone, ua = _runtime(qwen3_dir, torch.float32, adapters=2)
    joint, uj = _runtime(qwen3_dir, torch.float32, adapters=2)
    for step in range(2):
        for rt, units in ((alone, ua), (joint, uj)):
            for pair in (units[:2], units[2:]):
                _backward(rt, pair, step)
        expected = [torch_step(alone, u, hp) for u, hp in zip(ua, HPS)]
        assert joint.optim_steps(list(zip(uj, HPS))) == expected
    for i, (a, b) in enumerate(zip(ua, uj)):
        _assert_identical(alone, a, joint, b, f"unit {i}")


def test_the_norms_are_read_back_once(qwen3_dir, monkeypatch):
    """Four units' steps (fused AdamW, as on a GPU) wait for the device once: their gradient norms
    read back together, not per unit."""
    from tinsmith.devtools.host_syncs import HostSyncs

    monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    rt, units = _runtime(qwen3_dir, torch.float32)
    _backward(rt, units, 0)
    with HostSyncs() as h:
        rt.optim_steps(list(zip(units, HPS)))
    assert sum(h.by_site().values()) == 1, h.by_site()
    assert all(rt.unit(u).steps == 1 for u in units)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_joint_steps_after_a_loaded_state_or_a_move_use_the_state_there_now(qwen3_dir, monkeypatch, fused):
    """A checkpoint loaded into a unit, and its state's tensors replaced in place (as moving it
    between devices replaces them), are what the next joint step reads: the results equal a unit
    that only ever stepped alone. (What any caching of the units' AdamW state lists between joint
    steps must keep.)"""
    from tinsmith.worker.trainables import Trainable

    if fused:
        monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    alone, ua = _runtime(qwen3_dir, torch.float32)
    joint, uj = _runtime(qwen3_dir, torch.float32)
    for step in range(2):  # the first step makes the optimizer state, the second reads it
        _backward(alone, ua, step)
        _backward(joint, uj, step)
        assert joint.optim_steps(list(zip(uj, HPS))) == [torch_step(alone, u, hp) for u, hp in zip(ua, HPS)]
    # Unit 0 loads unit 2's state (other weights and moments) in both runtimes.
    for rt, units in ((alone, ua), (joint, uj)):
        rt.unit(units[0]).import_state(*rt.unit(units[2]).export_state())
    # Unit 1's state tensors are replaced by copies, as moving it between devices replaces them
    # (on a CPU nothing moves: they are replaced here as a move would, in the same entries).
    for rt, units in ((alone, ua), (joint, uj)):
        tr: Trainable = rt.unit(units[1])
        for st in tr.optimizer.state.values():
            for k, v in list(st.items()):
                st[k] = v.clone()
    for step in range(2, 4):
        _backward(alone, ua, step)
        _backward(joint, uj, step)
        assert joint.optim_steps(list(zip(uj, HPS))) == [torch_step(alone, u, hp) for u, hp in zip(ua, HPS)]
    for i, (a, b) in enumerate(zip(ua, uj)):
        _assert_identical(alone, a, joint, b, f"unit {i}")


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_joint_steps_with_a_tensor_left_out_then_back_equal_steps_alone(qwen3_dir, monkeypatch, fused):
    """A unit whose step leaves a tensor out (it got no gradient) steps only the others, and the
    steps after it, when every tensor steps again and that one's state is made then, read each
    tensor's own state: joint steps and steps alone agree bit for bit throughout. (The joint
    step keeps each unit's state lists between steps: what it must keep right.)"""
    if fused:
        monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    alone, ua = _runtime(qwen3_dir, torch.float32)
    joint, uj = _runtime(qwen3_dir, torch.float32)
    for step in range(4):
        _backward(alone, ua, step)
        _backward(joint, uj, step)
        if step in (0, 2):  # unit 0's first tensor has no gradient in these steps
            for rt, units in ((alone, ua), (joint, uj)):
                rt.unit(units[0]).params[0].grad = None
        assert joint.optim_steps(list(zip(uj, HPS))) == [torch_step(alone, u, hp) for u, hp in zip(ua, HPS)]
    tr = joint.unit(uj[0])
    assert tr.adamw_state_lists() is not None  # every tensor has its state by now
    assert int(tr.optimizer.state[tr.params[0]]["step"]) == 2 and int(tr.optimizer.state[tr.params[1]]["step"]) == 4
    for i, (a, b) in enumerate(zip(ua, uj)):
        _assert_identical(alone, a, joint, b, f"unit {i}")


@pytest.mark.parametrize("dtype,fused", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16-fused"])
def test_one_units_step_equals_its_optimizers_own_step(qwen3_dir, monkeypatch, dtype, fused):
    """``optim_step`` of one plain AdamW unit takes the joint step's kernel calls, not torch's
    optimizer (whose ``step()`` is never called for it), and lands where that ``step()`` would,
    bit for bit; a Dimuon unit still steps by its optimizer."""
    from tinsmith.worker.trainables import Trainable

    if fused:
        monkeypatch.setattr(families, "fused_adamw_fits", lambda params: True)
    kinds = ["adamw", "adamw", "dimuon", "adamw"]
    ref, ur = _runtime(qwen3_dir, dtype, optimizers=kinds)
    one, uo = _runtime(qwen3_dir, dtype, optimizers=kinds)
    stepped_by_torch: list[Trainable] = []
    real = Trainable.step

    def recorded(self, hp):
        stepped_by_torch.append(self)
        return real(self, hp)

    monkeypatch.setattr(Trainable, "step", recorded)
    hps = [HPS[0], HPS[1], DimuonParams(learning_rate=1e-2), HPS[3]]
    for step in range(3):
        _backward(ref, ur, step)
        _backward(one, uo, step)
        expected = [torch_step(ref, u, hp) for u, hp in zip(ur, hps)]
        assert [one.optim_step(u, hp) for u, hp in zip(uo, hps)] == expected
    assert expected[0]["grad_norm"] > 0.05  # clipped
    assert [tr for tr in stepped_by_torch if any(tr is one.unit(u) for u in uo)] == [one.unit(uo[2])] * 3
    for i, (a, b) in enumerate(zip(ur, uo)):
        _assert_identical(ref, a, one, b, f"unit {i}")


def test_one_units_refused_step_raises_and_applies_nothing(qwen3_dir):
    """A single step refused (another optimizer's hyperparameters, non-finite gradients) raises
    the error its optimizer's own step raises, and leaves the unit as it was; a unit without
    gradients reports the skipped step."""
    rt, units = _runtime(qwen3_dir, torch.float32)
    _backward(rt, units[:2], 0)
    before = rt.unit(units[0]).export_state()
    with pytest.raises(InvalidInputError, match="optimizer_params"):
        rt.optim_step(units[0], DimuonParams(learning_rate=1e-3))
    rt.unit(units[1]).params[0].grad[0, 0] = float("inf")
    with pytest.raises(InvalidInputError, match="NaN or infinity"):
        rt.optim_step(units[1], HPS[1])
    assert rt.optim_step(units[2], HPS[2]) == {"grad_norm": 0.0, "skipped_no_grad": 1.0}
    after = rt.unit(units[0]).export_state()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and after[1] == before[1] == {}
    assert [rt.unit(u).steps for u in units[:3]] == [0, 0, 0]
    assert rt.optim_step(units[0], HPS[0])["grad_norm"] > 0 and rt.unit(units[0]).steps == 1
