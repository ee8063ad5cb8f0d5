"""RL through the unmodified SDK: a reward that rises, one iteration of every RL loss, and the
check that on policy they all take the same step.

The toy task (``helpers``): after the prompt, sample COMPLETION_LEN tokens; the reward is the
fraction equal to TARGET. SFT first teaches "one of four choice tokens, uniformly", so the
sampler starts near reward 1/4 and the policy gradient has something to push on.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tests.e2e.helpers import RESULT_TIMEOUT_S, logprobs_of, lora_client
from tests.rl.helpers import (
    COMPLETION_LEN,
    PROMPT,
    all_finite,
    choice_sft_data,
    group_advantages,
    reward,
    rl_datum,
    train_steps_on,
    with_sampled_provenance,
)

pytestmark = pytest.mark.e2e

RANK = 16  # the shared server's cap
GROUP = 16
SFT_STEPS, SFT_LR = 20, 2e-2
RL_ITERS, RL_LR = 15, 7e-3


def _sample(sampler, seed: int, n: int = GROUP) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=COMPLETION_LEN, seed=seed, temperature=1.0, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=n, sampling_params=params)
    return list(res.result(timeout=RESULT_TIMEOUT_S).sequences)


@pytest.fixture
def sft_client(sc, base_model):
    """A LoRA run taught the toy task's format by SFT: every choice token about equally likely."""
    tc = lora_client(sc, base_model, rank=RANK, seed=0)
    losses = train_steps_on(tc, choice_sft_data(), SFT_STEPS, SFT_LR)
    uniform = len(choice_sft_data()) * np.log(4)  # the best a model can do on this data
    assert losses[-1] < 1.2 * uniform, losses
    return tc


def test_rl_reward_rises(sft_client, record_property):
    tc = sft_client
    rewards = []
    for it in range(RL_ITERS):
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        seqs = _sample(sampler, seed=1000 + it)
        assert all(len(s.tokens) == COMPLETION_LEN and len(s.logprobs) == COMPLETION_LEN for s in seqs)
        r = [reward(s.tokens) for s in seqs]
        rewards.append(float(np.mean(r)))
        data = [rl_datum(PROMPT, s, a) for s, a in zip(seqs, group_advantages(r))]
        fb = tc.forward_backward(data, "importance_sampling")
        op = tc.optim_step(types.AdamParams(learning_rate=RL_LR))
        out = fb.result(timeout=RESULT_TIMEOUT_S)
        op.result(timeout=RESULT_TIMEOUT_S)
        assert "loss:sum" in out.metrics and all_finite(out.metrics), out.metrics
        if it == 0:
            # the trainer scores the sampled tokens as the sampler did (same weights: ratio 1)
            p = len(PROMPT)
            for s, lp in zip(seqs, logprobs_of(out)):
                np.testing.assert_allclose(lp[p - 1:], s.logprobs, atol=2e-3, rtol=0)
    curve = " ".join(f"{x:.3f}" for x in rewards)
    record_property("reward_curve", curve)
    print(f"\nRL reward curve (importance_sampling, G={GROUP}): {curve}")
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert first < 0.5, rewards  # SFT left the target at about 1/4
    assert last > 0.75 and last - first > 0.3, rewards


def _with_prompt_logprobs(tc, data: list[types.Datum]) -> list[types.Datum]:
    """DRO's quadratic penalty applies at every position, so the prompt positions need the
    model's own logprobs there (the 0 the other losses accept would pull those towards 0)."""
    p = len(PROMPT)
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    current = logprobs_of(tc.forward(plain, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    out = []
    for d, lp in zip(data, current):
        inputs = dict(d.loss_fn_inputs)
        q = np.asarray(inputs["logprobs"].to_numpy(), dtype=np.float32).copy()
        q[:p - 1] = lp[:p - 1]
        inputs["logprobs"] = q
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs,
                               model_input_spans=d.model_input_spans, loss_fn_input_spans=d.loss_fn_input_spans))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "dro", "stable_reinforce"])
def test_rl_reward_rises_with_each_loss(sft_client, loss_fn):
    """The longer variant: the whole RL loop with every other policy-gradient loss."""
    tc = sft_client
    stability = loss_fn == "stable_reinforce"
    rewards = []
    for it in range(RL_ITERS + 5):
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=stability).result(
            timeout=RESULT_TIMEOUT_S)
        seqs = _sample(sampler, seed=2000 + it)
        r = [reward(s.tokens) for s in seqs]
        rewards.append(float(np.mean(r)))
        data = [rl_datum(PROMPT, s, a) for s, a in zip(seqs, group_advantages(r))]
        if loss_fn == "dro":
            data = _with_prompt_logprobs(tc, data)
        if stability:
            data = [with_sampled_provenance(d, len(PROMPT), s) for d, s in zip(data, seqs)]
        fb = tc.forward_backward(data, loss_fn)
        op = tc.optim_step(types.AdamParams(learning_rate=RL_LR))
        assert all_finite(fb.result(timeout=RESULT_TIMEOUT_S).metrics)
        op.result(timeout=RESULT_TIMEOUT_S)
    print(f"\nRL reward curve ({loss_fn}): " + " ".join(f"{x:.3f}" for x in rewards))
    assert np.mean(rewards[-3:]) > 0.75 and np.mean(rewards[-3:]) - np.mean(rewards[:3]) > 0.3, rewards


def _one_iteration(tc, loss_fn: str, seed: int, *, stability: bool = False,
                   extra_inputs=None, provenance: bool = False):
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=stability).result(
        timeout=RESULT_TIMEOUT_S)
    seqs = _sample(sampler, seed=seed, n=4)
    adv = group_advantages([reward(s.tokens) for s in seqs])
    if not any(adv):  # all rewards equal: still a valid batch, give it a signal anyway
        adv = [1.0, -1.0, 0.5, -0.5]
    data = []
    for s, a in zip(seqs, adv):
        d = rl_datum(PROMPT, s, a, extra_inputs(s) if extra_inputs else None)
        data.append(with_sampled_provenance(d, len(PROMPT), s) if provenance else d)
    return seqs, data


@pytest.mark.parametrize("loss_fn,config", [
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("dro", {"beta": 0.05}),
    ("importance_sampling", None),
])
def test_rl_losses_one_iteration(sc, base_model, loss_fn, config):
    tc = lora_client(sc, base_model, rank=8, seed=4)
    seqs, data = _one_iteration(tc, loss_fn, seed=7)
    out = tc.forward_backward(data, loss_fn, config).result(timeout=RESULT_TIMEOUT_S)
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
    assert "loss:sum" in out.metrics and all_finite(out.metrics), out.metrics
    assert [lp.shape for lp in logprobs_of(out)] == [(len(PROMPT) - 1 + len(s.tokens),) for s in seqs]
    assert opt is not None


def test_gspo_with_sequence_ratio_mask(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=5)
    p = len(PROMPT)
    seqs, data = _one_iteration(
        tc, "gspo", seed=8,
        extra_inputs=lambda s: {"sequence_ratio_mask": [0.0] * (p - 1) + [1.0] * len(s.tokens)})
    out = tc.forward_backward(data, "gspo").result(timeout=RESULT_TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
    assert "loss:sum" in out.metrics and all_finite(out.metrics), out.metrics
    assert np.isfinite(logprobs_of(out)[0]).all()


def test_stable_reinforce_uses_recorded_sampler_logprobs(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=6)
    seqs, data = _one_iteration(tc, "stable_reinforce", seed=9, stability=True, provenance=True)
    assert all(s.sequence_id for s in seqs)
    honest = tc.forward_backward(data, "stable_reinforce").result(timeout=RESULT_TIMEOUT_S)
    assert "loss:sum" in honest.metrics and all_finite(honest.metrics), honest.metrics

    # The same datums with the client's copy of the sampled logprobs spoiled: the server reads
    # the values it recorded at sampling time, so the result does not change.
    p = len(PROMPT)
    spoiled = []
    for d, s in zip(data, seqs):
        inputs = dict(d.loss_fn_inputs)
        inputs["logprobs"] = [0.0] * (p - 1) + [lp - 5.0 for lp in s.logprobs]
        spoiled.append(with_sampled_provenance(
            types.Datum(model_input=d.model_input, loss_fn_inputs=inputs), p, s))
    again = tc.forward_backward(spoiled, "stable_reinforce").result(timeout=RESULT_TIMEOUT_S)
    for key in ("loss:sum", "ratio:mean"):
        assert again.metrics[key] == pytest.approx(honest.metrics[key], rel=1e-5, abs=1e-6), key
    # control: a loss without provenance does see the spoiled values
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in spoiled]
    control = tc.forward(plain, "importance_sampling").result(timeout=RESULT_TIMEOUT_S)
    assert control.metrics["ratio:mean"] > 10 * honest.metrics["ratio:mean"]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)


def test_on_policy_losses_take_the_same_step(sc, base_model):
    """On policy (sampler = trainer weights, so every ratio is 1) the policy-gradient losses share
    one gradient, sum(A * dlogp): importance_sampling, ppo, cispo, stable_reinforce and dro (with
    the trainer's own logprobs as q, where its penalty has zero gradient) must take the same step
    from the same start. A sign or scale slip in any one of them shows up as a different model."""
    first = lora_client(sc, base_model, rank=8, seed=31)
    sampler = first.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=RESULT_TIMEOUT_S)
    seqs = _sample(sampler, seed=77, n=8)
    adv = group_advantages([reward(s.tokens) for s in seqs])
    if not any(adv):
        adv = [1.0, -1.0] * 4
    data = [with_sampled_provenance(rl_datum(PROMPT, s, a), len(PROMPT), s) for s, a in zip(seqs, adv)]
    probe = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    after = {}
    for loss_fn in ("importance_sampling", "ppo", "cispo", "stable_reinforce", "dro"):
        tc = first if loss_fn == "importance_sampling" else lora_client(sc, base_model, rank=8, seed=31)
        batch = _with_prompt_logprobs(tc, data) if loss_fn == "dro" else data
        out = tc.forward_backward(batch, loss_fn).result(timeout=RESULT_TIMEOUT_S)
        assert all_finite(out.metrics), (loss_fn, out.metrics)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=RESULT_TIMEOUT_S)
        after[loss_fn] = logprobs_of(tc.forward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    start = logprobs_of(lora_client(sc, base_model, rank=8, seed=31).forward(probe, "cross_entropy")
                        .result(timeout=RESULT_TIMEOUT_S))
    ref = after["importance_sampling"]
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref, start)) > 1e-2  # the step moved the model
    for loss_fn, lps in after.items():
        for a, b in zip(lps, ref):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=loss_fn)
