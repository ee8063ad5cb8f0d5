"""Unmodified tinker-cookbook 0.6.1 recipes against tinsmith (``python -m tinker_cookbook.recipes...``).

Each recipe runs from the offline mirror with the smallest sizes that still exercise its calls,
then the test reads what it wrote: ``metrics.jsonl`` rows (steps, expected keys, finite values,
values that only make sense if the server computed the right thing) and ``checkpoints.jsonl``
(tinker:// paths; the final state and sampler load in this process and hold the same weights).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.compat.helpers import Run, base_model_sampling_sessions
from tests.compat.mirror import STUDENT, TEACHER, VLM

pytestmark = pytest.mark.compat

DELETE = "behavior_if_log_dir_exists=delete"
# Sampling and training logprobs of the same tokens under the same weights agree to float error;
# the cookbook logs the difference as optim/kl_sample_train_v1 (mean of old - new logprob).
KL_SAMPLE_TRAIN_TOL = 2e-3


def _config(run) -> dict:
    return json.loads((run.log_path / "config.json").read_text())


def _rl_common_checks(run, rows: list[dict]) -> None:
    for r in rows:
        kl = r["optim/kl_sample_train_v1"]
        assert abs(kl) < KL_SAMPLE_TRAIN_TOL, f"step {r['step']}: sampler and trainer logprobs disagree ({kl})"
        assert r["optim/entropy"] > 0
        assert r["env/all/total_episodes"] > 0


def test_sl_loop(cookbook, check_final_checkpoint):
    """Flat SFT loop on (mirrored) no_robots: cross_entropy + optim_step, periodic state save, final both."""
    run = cookbook("tinker_cookbook.recipes.sl_loop", "batch_size=8", "max_steps=4", "save_every=2", "lora_rank=4",
                   "learning_rate=5e-3")
    rows = run.check_metrics(steps=[0, 1, 2, 3], keys=("train_mean_nll", "train_mean_bpb", "num_sequences",
                                                       "num_tokens", "learning_rate"))
    assert all(r["num_sequences"] == 8 for r in rows)
    nll = run.column("train_mean_nll")
    assert 0 < nll[0] < 2 * math.log(1024), nll  # about log(vocab) for a random model
    assert nll[-1] < nll[0], f"NLL did not fall over 4 steps at lr 5e-3: {nll}"
    ck = run.check_checkpoints(["000002", "final"], sampler={"final"})
    check_final_checkpoint(ck[-1], base_model=STUDENT)


def test_rl_loop_stable_reinforce(cookbook, check_final_checkpoint):
    """Flat GRPO loop on (mirrored) GSM8K with its default loss, stable_reinforce: samplers with
    record_stability_info, num_samples=group_size, provenance spans on every datum."""
    run = cookbook("tinker_cookbook.recipes.rl_loop", "batch_size=2", "group_size=4", "max_tokens=12", "max_steps=3",
                   "save_every=2", "lora_rank=4")
    assert _config(run)["loss_fn"] == "stable_reinforce"
    rows = run.check_metrics(steps=[0, 1, 2], keys=("reward/total", "progress/batch", "optim/lr"))
    assert all(0.0 <= r["reward/total"] <= 1.0 for r in rows)
    trained = [r for r in rows if "grad_norm" in r]  # optim_step metrics appear only when a step trained
    skipped = run.output.count("all advantages zero, skipping training step")
    assert len(trained) + skipped == 3
    assert trained, "every batch had constant rewards: forward_backward(stable_reinforce) never ran"
    assert all(r["grad_norm"] > 0 for r in trained), trained
    assert any(r["reward/total"] > 0 for r in rows), "the warm-started model never boxed the right digit"
    ck = run.check_checkpoints(["000002", "final"], sampler={"final"})
    check_final_checkpoint(ck[-1], base_model=STUDENT)


def test_math_rl_arithmetic(cookbook, check_final_checkpoint):
    """rl.train (sync) on the synthetic arithmetic env, default loss stable_reinforce."""
    run = cookbook("tinker_cookbook.recipes.math_rl.train", f"model_name={STUDENT}", "renderer_name=role_colon",
                   "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=16", "lora_rank=4",
                   "max_steps=3", "save_every=2", DELETE)
    rows = run.check_metrics(steps=[0, 1, 2], keys=("env/all/reward/total", "env/all/format",
                                                    "env/all/by_group/frac_mixed", "optim/kl_sample_train_v1",
                                                    "optim/entropy", "grad_norm", "learning_rate"))
    _rl_common_checks(run, rows)
    assert any(r["env/all/by_group/frac_mixed"] > 0 for r in rows), "no group with mixed rewards"
    assert any(r["grad_norm"] > 0 for r in rows)
    ck = run.check_checkpoints(["000002", "final"], sampler={"000002", "final"})
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")


def test_chat_sl_local_jsonl(cookbook, cookbook_data, compat_mirror, check_final_checkpoint):
    """supervised.train through chat_sl on the wheel's conversations.jsonl, with the model named by
    its absolute local path (the server serves that path as a base model)."""
    model = str(compat_mirror / STUDENT)
    run = cookbook("tinker_cookbook.recipes.chat_sl.train", f"model_name={model}", "renderer_name=role_colon",
                   f"dataset={cookbook_data / 'conversations.jsonl'}", "batch_size=8", "max_length=256", "lora_rank=4",
                   "max_steps=3", "save_every=2", "learning_rate=1e-3", DELETE)
    rows = run.check_metrics(steps=[0, 1, 2], keys=("train_mean_nll", "num_loss_tokens", "num_tokens", "grad_norm"))
    assert all(r["num_loss_tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    ck = run.check_checkpoints(["000002", "final"], sampler={"000002", "final"})
    check_final_checkpoint(ck[-1], base_model=model, renderer_name="role_colon")


def test_dpo_hhh(cookbook, check_final_checkpoint):
    """DPO on (mirrored) hh-rlhf: reference compute_logprobs + forward_backward_custom (forward,
    then cross_entropy with signed weights)."""
    run = cookbook("tinker_cookbook.recipes.preference.dpo.train", "dataset=hhh", "batch_size=4", "max_length=256",
                   "max_steps=3", "learning_rate=1e-3", DELETE)
    rows = run.check_metrics(steps=[0, 1, 2], keys=("dpo_loss", "accuracy", "margin", "chosen_reward",
                                                    "rejected_reward", "num_pairs"))
    # At step 0 the policy is the reference: every implicit reward is 0 and the loss is log 2.
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert abs(rows[0]["margin"]) < 1e-3 and abs(rows[0]["chosen_reward"]) < 1e-3
    # After two optimizer steps the policy has moved away from the reference.
    assert abs(rows[-1]["chosen_reward"]) + abs(rows[-1]["rejected_reward"]) > 1e-4, rows[-1]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    ck = run.check_checkpoints(["final"])
    check_final_checkpoint(ck[-1], base_model=STUDENT)


def test_preference_shorter(cookbook, check_final_checkpoint):
    """Pairwise-preference RL with a rule-based judge and compute_post_kl (prompt-logprob scoring)."""
    run = cookbook("tinker_cookbook.recipes.preference.shorter.train", f"model_name={STUDENT}",
                   "renderer_name=role_colon", "batch_size=2", "group_size=2", "max_tokens=16", "max_steps=2", DELETE)
    rows = run.check_metrics(steps=[0, 1], keys=("env/all/win_minus_loss", "kl_pre_post_v1", "kl_pre_post_v2",
                                                 "optim/kl_sample_train_v1", "grad_norm"))
    _rl_common_checks(run, rows)
    assert all(r["kl_pre_post_v2"] >= 0 for r in rows)
    ck = run.check_checkpoints(["final"])
    # A step whose every pair tied (the random model's two answers equally long, so the judge
    # prefers neither) has zero advantages and no gradient; when both steps did, the adapter rightly
    # stays the base model (B starts at zero), as it does in about one run of ten.
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon",
                           trained=any(r["grad_norm"] > 0 for r in rows))


def test_guess_number_qwen3_5_renderer(cookbook, check_final_checkpoint):
    """Multi-turn RL with the recipe's own defaults for model (Qwen/Qwen3.5-4B) and renderer
    (qwen3_5_disable_thinking: <|im_end|> token-id stops, special tokens in the prompt)."""
    run = cookbook("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", "group_size=2", "batch_size=2",
                   "max_tokens=8", "max_steps=2", "eval_every=0", "save_every=0", DELETE)
    assert _config(run)["renderer_name"] == "qwen3_5_disable_thinking"
    rows = run.check_metrics(steps=[0, 1], keys=("env/all/turns_per_episode", "env/all/reward/total",
                                                 "optim/kl_sample_train_v1", "grad_norm"))
    _rl_common_checks(run, rows)
    assert all(r["env/all/turns_per_episode"] > 1 for r in rows), "episodes were not multi-turn"
    assert all(r["env/all/ob_tokens_per_turn"] > 100 for r in rows)  # the growing multi-turn prompts
    ck = run.check_checkpoints(["final"])
    # The tiny model never guesses the number, so every group has one reward and zero advantages:
    # grad_norm is 0 and the final weights equal the base model's (checked with trained=False).
    assert all(r["grad_norm"] == 0.0 for r in rows if r["env/all/by_group/frac_mixed"] == 0.0)
    check_final_checkpoint(ck[-1], base_model="Qwen/Qwen3.5-4B", renderer_name="qwen3_5_disable_thinking",
                           trained=any(r["env/all/by_group/frac_mixed"] > 0 for r in rows))


def test_on_policy_distillation(cookbook, compat_server, check_final_checkpoint):
    """Student rollouts + teacher (Qwen/Qwen3.5-9B, other weights) compute_logprobs + importance_sampling."""
    run = cookbook("tinker_cookbook.recipes.distillation.on_policy_distillation", "dataset=deepmath",
                   "groups_per_batch=2", "group_size=2", "max_tokens=16", "lora_rank=4", "max_steps=2", DELETE)
    cfg = _config(run)
    assert cfg["model_name"] == STUDENT and cfg["dataset_configs"][0]["teacher_config"]["base_model"] == TEACHER
    rows = run.check_metrics(steps=[0, 1], keys=("teacher_kl", "optim/kl_sample_train_v1", "grad_norm"))
    _rl_common_checks(run, rows)
    # The teacher has other weights than the student: their KL on the student's samples is positive.
    assert all(r["teacher_kl"] > 1e-3 for r in rows), [r["teacher_kl"] for r in rows]
    assert base_model_sampling_sessions(compat_server, TEACHER) >= 1  # teacher = a bare base-model sampler
    ck = run.check_checkpoints(["final"])
    check_final_checkpoint(ck[-1], base_model=STUDENT)


def test_prompt_distillation_train(cookbook, cookbook_data, check_final_checkpoint):
    """prompt_distillation's SFT stage on a local conversation file (epoch loop, its own recipe name)."""
    run = cookbook("tinker_cookbook.recipes.prompt_distillation.train", f"model_name={STUDENT}",
                   "renderer_name=role_colon", f"file_path={cookbook_data / 'conversations.jsonl'}", "batch_size=8",
                   "max_length=256", "num_epochs=1", "max_steps=3", "lora_rank=4", DELETE)
    rows = run.check_metrics(steps=[0, 1, 2], keys=("train_mean_nll", "num_loss_tokens", "grad_norm"))
    assert all(r["train_mean_nll"] > 0 for r in rows)
    ck = run.check_checkpoints(["final"])
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")


def test_decisions_sample_decision(cookbook):
    """decisions: ``sample_decision`` scores every label token at the answer position in one sparse
    ``target_prompt_logprobs`` request; its probabilities equal a softmax of the same logprobs read
    through ``include_prompt_logprobs``."""
    run = cookbook("decisions_check.py", f"--model={STUDENT}", pass_log_path=False)
    out = json.loads([line for line in run.output.splitlines() if line.startswith("{")][-1])
    probs, ref = out["probabilities"], out["reference_logprobs"]
    assert list(probs) == ["billing", "sdk", "console", "cookbook"] and list(ref) == list(probs)
    assert abs(sum(probs.values()) - 1.0) < 1e-5 and all(p > 0 for p in probs.values())
    z = sum(math.exp(v) for v in ref.values())
    for label, p in probs.items():
        assert abs(p - math.exp(ref[label]) / z) < 1e-4, (label, p, ref)


def test_vlm_classifier_on_an_image_text_qwen3_5(cookbook, tmp_path, check_final_checkpoint):
    """vlm_classifier (its defaults: Qwen3.5-397B-A17B, renderer qwen3_5_disable_thinking) on the
    (mirrored) caltech101 image folder: the cookbook's renderer turns each photo into an image
    chunk whose token count its own image processor computed (a text-only model, or a count that
    differs from the server's, is a 400 and the run fails), supervised.train runs cross_entropy
    on them, and the sampling evaluator classifies test photos."""
    run = cookbook("tinker_cookbook.recipes.vlm_classifier.train", f"experiment_dir={tmp_path}", "dataset=caltech101",
                   "batch_size=4", "max_steps=3", "lora_rank=4", "learning_rate=1e-2", "eval_every=2", "save_every=2",
                   "n_eval=4", "max_tokens=8", "behavior_if_log_dir_exists=delete", pass_log_path=False)
    (metrics,) = tmp_path.rglob("metrics.jsonl")
    run = Run(metrics.parent, run.output)
    assert f"-{VLM.replace('/', '-')}-" in metrics.parent.name  # the recipe's default model
    rows = run.check_metrics(keys=("train_mean_nll", "num_loss_tokens"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    nll = run.column("train_mean_nll")
    assert nll[-1] < nll[0], f"NLL did not fall over 3 steps at lr 1e-2: {nll}"
    assert run.column("test/nll"), "the NLL evaluator (forward over test photos) logged nothing"
    accuracy = [v for r in run.metrics for k, v in r.items() if k.endswith("accuracy")]
    assert accuracy and all(0.0 <= a <= 1.0 for a in accuracy), run.metrics  # the evaluator sampled after images
    ck = run.check_checkpoints(["000002", "final"], sampler={"final"})
    check_final_checkpoint(ck[-1], base_model=VLM)
