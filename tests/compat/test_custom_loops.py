"""The cookbook's RL and SL loops driven from user scripts (``scripts/custom_rl.py``,
``scripts/custom_sl.py``): a custom ``ProblemEnv``/``RLDataset`` task, the sync/async/streaming
variants, KL penalty against the base model, post-update KL, test-set evaluation, and resuming
from ``log_path``.

Besides what the runs wrote, these tests read the server's request log (its SQLite store) to
check what reached it: how many ``forward_backward`` per ``optim_step``, and that a resume loaded
the saved state *with* its optimizer.
"""

from __future__ import annotations

import json

import pytest

from tests.compat.helpers import load_requests, request_kinds, run_id_of
from tests.compat.mirror import STUDENT

pytestmark = pytest.mark.compat

KL_SAMPLE_TRAIN_TOL = 2e-3


def _loaded_with_optimizer(server, model_id: str) -> str:
    """The path the run's single load_weights request loaded, checking it restored the optimizer
    too (the SDK's create_training_client_from_state_with_optimizer)."""
    loads = load_requests(server, model_id)
    assert len(loads) == 1, loads
    assert loads[0].get("optimizer") is True, loads[0]
    return loads[0]["path"]


def _rl(cookbook, log_path, *args: str):
    return cookbook("custom_rl.py", "--model", STUDENT, *args, log_path=log_path)


def _rl_rows_ok(run, rows):
    for r in rows:
        assert abs(r["optim/kl_sample_train_v1"]) < KL_SAMPLE_TRAIN_TOL, r["optim/kl_sample_train_v1"]
        assert r["env/all/total_episodes"] == 8  # 2 groups x 4 samples


def test_custom_rl_sync_kl_penalty_post_kl_eval_then_resume(cookbook, compat_server, tmp_path, check_final_checkpoint):
    lp = tmp_path / "rl"
    run = _rl(cookbook, lp, "--max-steps", "3", "--save-every", "2", "--eval-every", "1", "--kl-penalty-coef", "0.05",
              "--post-kl")
    rows = run.check_metrics(steps=[0, 1, 2], keys=(
        "env/all/reward/total", "env/all/correct", "kl_policy_base",  # KL penalty: base-model sampler scoring
        "kl_pre_post_v1", "kl_pre_post_v2",  # compute_post_kl: scoring on the new sampler
        "test/env/all/reward/total",  # RLTestSetEvaluator
        "optim/kl_sample_train_v1", "grad_norm"))
    _rl_rows_ok(run, rows)
    # Step 0 samples the untrained adapter, which is the base model: the policy/base KL is ~0.
    assert abs(rows[0]["kl_policy_base"]) < KL_SAMPLE_TRAIN_TOL
    assert any(r["grad_norm"] > 0 for r in rows)
    first = run.check_checkpoints(["000002", "final"], sampler={"000002", "final"})
    model_id = run_id_of(first[-1]["state_path"])
    kinds = request_kinds(compat_server, model_id)
    assert kinds["optim_step"] == 3 and kinds["forward_backward"] == 3, kinds

    # Same log_path again with a higher max_steps: the loop resumes from the last state_path.
    resumed = _rl(cookbook, lp, "--max-steps", "5", "--save-every", "2", "--kl-penalty-coef", "0.05", "--post-kl")
    assert f"Resumed training from {first[-1]['state_path']}" in resumed.output
    rows = resumed.check_metrics(steps=[0, 1, 2, 3, 4], keys=("env/all/reward/total", "kl_policy_base"))
    _rl_rows_ok(resumed, rows[3:])
    ck = resumed.check_checkpoints(["000002", "final", "000004", "final"], sampler={"000002", "final", "000004"})
    new_id = run_id_of(ck[-1]["state_path"])
    assert new_id != model_id and ck[-2]["batch"] == 4 and ck[-1]["batch"] == 5
    kinds = request_kinds(compat_server, new_id)
    assert kinds["optim_step"] == 2, kinds  # steps 3 and 4 only
    assert _loaded_with_optimizer(compat_server, new_id) == first[-1]["state_path"]
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")


def test_custom_rl_async_off_policy(cookbook, compat_server, tmp_path, check_final_checkpoint):
    run = _rl(cookbook, tmp_path / "rl", "--mode", "async", "--max-steps", "3", "--save-every", "0")
    rows = run.check_metrics(keys=("async/staleness_max", "sampling_client/step_max", "training_client/step",
                                   "optim/kl_sample_train_v1", "grad_norm"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["async/staleness_max"] <= 2 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    for r in rows:  # off-policy samples: the KL is measured against the sampler that made them
        assert abs(r["optim/kl_sample_train_v1"]) < 0.5
    # The async loop saves the step-0 sampler state too, whatever save_every says.
    ck = run.check_checkpoints(["000000", "final"], sampler={"000000", "final"})
    kinds = request_kinds(compat_server, run_id_of(ck[-1]["state_path"]))
    assert kinds["optim_step"] == 3 and kinds["forward_backward"] == 3, kinds
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")


def test_custom_rl_stream_minibatches(cookbook, compat_server, tmp_path, check_final_checkpoint):
    run = _rl(cookbook, tmp_path / "rl", "--mode", "stream", "--groups-per-batch", "4", "--max-steps", "2",
              "--save-every", "0")
    rows = run.check_metrics(steps=[0, 1], keys=("env/all/reward/total", "optim/kl_sample_train_v1", "grad_norm"))
    assert all(r["env/all/total_episodes"] == 16 for r in rows)
    ck = run.check_checkpoints(["final"])
    kinds = request_kinds(compat_server, run_id_of(ck[-1]["state_path"]))
    # Two minibatches per optimizer step: two forward_backward calls accumulate into each optim_step.
    assert kinds["optim_step"] == 2 and kinds["forward_backward"] == 4, kinds
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")


def test_custom_sl_eval_then_resume_after_interruption(cookbook, cookbook_data, compat_server, tmp_path,
                                                       check_final_checkpoint):
    lp = tmp_path / "sl"
    args = ["--model", STUDENT, "--file", str(cookbook_data / "conversations.jsonl")]
    run = cookbook("custom_sl.py", *args, "--max-steps", "3", log_path=lp)
    rows = run.check_metrics(steps=[0, 1, 2], keys=("train_mean_nll", "test/nll", "test/bpb", "grad_norm"))
    # NLL evaluator: compute_logprobs on a fresh sampler of the current weights each step.
    assert all(0 < r["test/nll"] < 20 for r in rows)
    first = run.check_checkpoints(["000002", "final"], sampler={"000002", "final"})

    # The SL loop records "final" as the end of the data, so resuming after it has nothing left to
    # do. Make it look as if the process died after the step-2 checkpoint instead, then re-run.
    (lp / "checkpoints.jsonl").write_text(json.dumps(first[0]) + "\n")
    resumed = cookbook("custom_sl.py", *args, "--max-steps", "5", log_path=lp)
    rows = resumed.check_metrics(keys=("train_mean_nll", "grad_norm"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4], [r["step"] for r in rows]
    # The resumed process starts at step 2 and saves "000002" again (from the loaded weights).
    ck = resumed.check_checkpoints(["000002", "000002", "000004", "final"], sampler={"000002", "000004", "final"})
    new_id = run_id_of(ck[-1]["state_path"])
    assert new_id != run_id_of(first[0]["state_path"])
    kinds = request_kinds(compat_server, new_id)
    assert kinds["optim_step"] == 3 and kinds["load_weights"] == 1, kinds  # steps 2, 3 and 4 after the load
    assert _loaded_with_optimizer(compat_server, new_id) == first[0]["state_path"]
    check_final_checkpoint(ck[-1], base_model=STUDENT, renderer_name="role_colon")
