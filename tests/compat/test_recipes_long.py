"""Longer tinker-cookbook runs (``-m compat_long``): recipes whose smallest useful run costs
minutes on a CPU box, their test-set evaluations, and the other loss functions of the RL loops.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.compat.helpers import Run, base_model_sampling_sessions, load_requests, run_id_of, sampling_sessions_on
from tests.compat.mirror import STUDENT, TEACHER

pytestmark = pytest.mark.compat_long

DELETE = "behavior_if_log_dir_exists=delete"
KL_SAMPLE_TRAIN_TOL = 2e-3


def _rl_rows_ok(rows):
    for r in rows:
        assert abs(r["optim/kl_sample_train_v1"]) < KL_SAMPLE_TRAIN_TOL, r["optim/kl_sample_train_v1"]
        assert r["env/all/total_episodes"] > 0


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "cispo", "gspo"])
def test_rl_loop_other_losses(cookbook, loss_fn, check_final_checkpoint):
    run = cookbook("tinker_cookbook.recipes.rl_loop", "batch_size=2", "group_size=4", "max_tokens=12", "max_steps=3",
                   "save_every=0", "lora_rank=4", f"loss_fn={loss_fn}", name=f"rl_loop_{loss_fn}")
    rows = run.check_metrics(steps=[0, 1, 2], keys=("reward/total",))
    trained = [r for r in rows if "grad_norm" in r]
    assert trained and all(r["grad_norm"] > 0 for r in trained), rows
    ck = run.check_checkpoints(["final"])
    check_final_checkpoint(ck[-1], base_model=STUDENT)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_math_rl_other_losses(cookbook, loss_fn):
    run = cookbook("tinker_cookbook.recipes.math_rl.train", f"model_name={STUDENT}", "renderer_name=role_colon",
                   "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=16", "lora_rank=4",
                   "max_steps=3", "save_every=0", f"loss_fn={loss_fn}", DELETE, name=f"math_rl_{loss_fn}")
    rows = run.check_metrics(steps=[0, 1, 2], keys=("env/all/reward/total", "optim/kl_sample_train_v1", "grad_norm"))
    _rl_rows_ok(rows)
    assert json.loads((run.log_path / "config.json").read_text())["loss_fn"] == loss_fn
    run.check_checkpoints(["final"])


def test_math_rl_async_and_stream_cli(cookbook):
    """The async and streaming variants through math_rl's own CLI (not a user script)."""
    run = cookbook("tinker_cookbook.recipes.math_rl.train", f"model_name={STUDENT}", "renderer_name=role_colon",
                   "env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=16", "lora_rank=4",
                   "max_steps=3", "save_every=0", "max_steps_off_policy=1", DELETE, name="math_rl_async")
    rows = run.check_metrics(keys=("async/staleness_max", "grad_norm"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    run = cookbook("tinker_cookbook.recipes.math_rl.train", f"model_name={STUDENT}", "renderer_name=role_colon",
                   "env=arithmetic", "group_size=4", "groups_per_batch=4", "max_tokens=16", "lora_rank=4",
                   "max_steps=2", "save_every=0", "stream_minibatch_config.groups_per_batch=4",
                   "stream_minibatch_config.num_minibatches=2", DELETE, name="math_rl_stream")
    run.check_metrics(steps=[0, 1], keys=("env/all/reward/total", "grad_norm"))


def test_math_rl_resume_from_log_path(cookbook):
    args = [f"model_name={STUDENT}", "renderer_name=role_colon", "env=arithmetic", "group_size=4",
            "groups_per_batch=2", "max_tokens=16", "lora_rank=4", "save_every=2"]
    first = cookbook("tinker_cookbook.recipes.math_rl.train", *args, "max_steps=3", DELETE, name="math_rl_resume")
    ck = first.check_checkpoints(["000002", "final"], sampler={"000002", "final"})
    again = cookbook("tinker_cookbook.recipes.math_rl.train", *args, "max_steps=5", "behavior_if_log_dir_exists=resume",
                     log_path=first.log_path)
    assert f"Resumed training from {ck[-1]['state_path']}" in again.output
    again.check_metrics(steps=[0, 1, 2, 3, 4], keys=("env/all/reward/total",))
    ck2 = again.check_checkpoints(["000002", "final", "000004", "final"], sampler={"000002", "final", "000004"})
    assert run_id_of(ck2[-1]["state_path"]) != run_id_of(ck[-1]["state_path"])


def test_guess_number_with_test_set_eval(cookbook):
    """One step with the recipe's test-set evaluation (103 numbers x 4 samples x 10 turns)."""
    run = cookbook("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", "group_size=2", "batch_size=2",
                   "max_tokens=8", "max_steps=1", "eval_every=1", "save_every=0", DELETE, name="guess_number_eval")
    rows = run.check_metrics(steps=[0], keys=("test/env/all/reward/total", "test/env/all/turns_per_episode",
                                             "env/all/reward/total"))
    assert rows[0]["test/env/all/total_episodes"] == 412


def test_twenty_questions(cookbook, compat_server):
    """Player Qwen/Qwen3.5-4B against a base-model answerer hard-coded to Qwen/Qwen3.5-9B."""
    run = cookbook("tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train", "batch_size=2", "group_size=2",
                   "max_steps=1", "eval_every=0", "save_every=0", DELETE)
    rows = run.check_metrics(steps=[0], keys=("env/all/reward/total", "optim/kl_sample_train_v1"))
    _rl_rows_ok(rows)
    assert rows[0]["env/all/turns_per_episode"] > 1
    assert base_model_sampling_sessions(compat_server, TEACHER) >= 1  # the answerer
    run.check_checkpoints(["final"])


def test_sl_and_rl_basic_blueprints(cookbook):
    """sl_basic and rl_basic (chz Blueprints) on the mirrored no_robots and GSM8K, default builders."""
    run = cookbook("tinker_cookbook.recipes.sl_basic", "max_steps=2", "lora_rank=4", name="sl_basic")
    run.check_metrics(steps=[0, 1], keys=("train_mean_nll", "grad_norm"))
    run.check_checkpoints(["final"])
    # rl_basic: its builder's batch is 128 prompts x 16 samples (no CLI override without replacing it)
    run = cookbook("tinker_cookbook.recipes.rl_basic", "max_steps=1", "lora_rank=4", "max_tokens=12",
                   "save_every=0", name="rl_basic", timeout=1200)
    rows = run.check_metrics(steps=[0], keys=("env/all/reward/total", "optim/kl_sample_train_v1"))
    assert rows[0]["env/all/total_episodes"] == 128 * 16
    _rl_rows_ok(rows)


def test_rlhf_pipeline(cookbook, compat_server, tmp_path):
    """SFT -> reward model -> RL against the RM sampler (temperature 0, max_tokens 1), three stages.
    The recipe has no log_path option: it logs under TINKER_COOKBOOK_RUNS_DIR."""
    run = cookbook("tinker_cookbook.recipes.preference.rlhf.rlhf_pipeline", "batch_size=8", "max_steps=1",
                   "lora_rank=4", "rl_max_tokens=16", "max_length=256", pass_log_path=False,
                   env={"TINKER_COOKBOOK_RUNS_DIR": str(tmp_path)}, timeout=1200)
    stages = {p.parent.name: Run(p.parent, run.output) for p in tmp_path.rglob("metrics.jsonl")}
    assert sorted(stages) == ["rl", "rm", "sft"], (sorted(stages), run.output[-3000:])
    for name in ("sft", "rm"):  # supervised.train: SFT on no_robots, then the RM on hh-rlhf comparisons
        stages[name].check_metrics(steps=[0], keys=("train_mean_nll", "test/nll", "grad_norm"))
    # (its evaluator, a win rate against the SFT policy, adds a last row of its own)
    rl = [r for r in stages["rl"].check_metrics() if "env/all/win_minus_loss" in r]
    assert [r["step"] for r in rl] == [0]
    _rl_rows_ok(rl)
    assert all(0.0 <= r["win_rate"] <= 1.0 for r in stages["rl"].metrics if "win_rate" in r)
    cks = {name: r.check_checkpoints(["final"]) for name, r in stages.items()}
    # The RL stage starts from the SFT weights (create_training_client_from_state, no optimizer) and
    # is judged by samplers of the RM's final sampler weights.
    rl_run = run_id_of(cks["rl"][-1]["state_path"])
    loads = load_requests(compat_server, rl_run)
    assert [ld["path"] for ld in loads] == [cks["sft"][-1]["state_path"]] and not loads[0].get("optimizer"), loads
    assert sampling_sessions_on(compat_server, cks["rm"][-1]["sampler_path"]) >= 1


def test_rl_numerics_check(cookbook):
    """Many-turn episodes on (mirrored) wikitext, model id with a :peft:<ctx> suffix."""
    run = cookbook("tinker_cookbook.recipes.rl_numerics_check.train", "group_size=2", "groups_per_batch=2",
                   "max_tokens=16", "task.num_pages_min=1", "task.num_pages_max=2", "task.page_chars=200",
                   "max_steps=1", "lora_rank=4", DELETE)
    rows = run.check_metrics(steps=[0], keys=("env/all/reward/total", "optim/kl_sample_train_v1"))
    _rl_rows_ok(rows)


def test_rubric_generate_data_and_train(cookbook, cookbook_python, compat_workdir, compat_env, compat_server):
    """LLM-as-grader RL: the grader is a base-model sampler (Qwen/Qwen3.6-35B-A3B) behind a
    TinkerMessageCompleter; default loss stable_reinforce."""
    # generate_data writes ./tinker_cookbook/example_data/*.jsonl (the train defaults read them there)
    (compat_workdir / "tinker_cookbook" / "example_data").mkdir(parents=True, exist_ok=True)
    gen = subprocess.run([str(cookbook_python), "-m", "tinker_cookbook.recipes.rubric.generate_data"],
                         cwd=compat_workdir, env=compat_env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    run = cookbook("tinker_cookbook.recipes.rubric.train", "groups_per_batch=2", "train_group_size=2",
                   "max_tokens=8", "max_steps=2", "lora_rank=4", "eval_every=0", "save_every=0", DELETE)
    rows = run.check_metrics(steps=[0, 1], keys=("env/all/reward/total", "optim/kl_sample_train_v1"))
    _rl_rows_ok(rows)
    assert json.loads((run.log_path / "config.json").read_text())["loss_fn"] == "stable_reinforce"
    assert base_model_sampling_sessions(compat_server, "Qwen/Qwen3.6-35B-A3B") >= 1  # the grader


def test_distillation_tulu3_and_multi_teacher(cookbook):
    run = cookbook("tinker_cookbook.recipes.distillation.on_policy_distillation", "dataset=tulu3",
                   "groups_per_batch=2", "group_size=2", "max_tokens=16", "lora_rank=4", "max_steps=2", DELETE,
                   name="opd_tulu3")
    rows = run.check_metrics(steps=[0, 1], keys=("teacher_kl",))
    assert all(r["teacher_kl"] > 0 for r in rows)
    run = cookbook("tinker_cookbook.recipes.distillation.on_policy_multi_teacher", f"model_name={STUDENT}",
                   "renderer_name=role_colon", f"deepmath_teacher_model={TEACHER}",
                   f"tulu3_teacher_model={TEACHER}", "deepmath_groups_per_batch=2", "tulu3_groups_per_batch=2",
                   "group_size=2", "max_tokens=16", "lora_rank=4", "max_steps=2", DELETE, name="opd_multi")
    run.check_metrics(steps=[0, 1], keys=("optim/kl_sample_train_v1",))
