"""The end-to-end SDK suite on CUDA: the real server on ``--device cuda``, the real ``tinker`` SDK.

Numbers are compared with an fp32 CPU reference of the same (bf16-stored) weights at bf16
tolerance; ``test_fp32_mode_is_exact`` holds the server to fp32 rounding where it has ``--dtype``.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from tinker import types

from tests.conftest import SMALL
from tests.e2e.helpers import (
    RESULT_TIMEOUT_S,
    gathered_logprobs,
    logprobs_of,
    lora_client,
    loss_sum,
    random_tokens,
    repeated_pattern_batch,
    sft_datum,
    train_steps,
)
from tests.gpu.conftest import DEVICE, FP32, HAS_DTYPE_OPTION, Tolerance

VOCAB = SMALL.vocab_size
ADAM = types.AdamParams(learning_rate=1e-2)


def _reference(model_dir: str, data: list[types.Datum]) -> list[np.ndarray]:
    """Target logprobs from ``transformers`` in fp32 on the CPU, same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return gathered_logprobs(model, data)


def _assert_close(ours: list[np.ndarray], ref: list[np.ndarray], tol: Tolerance) -> None:
    a, b = np.concatenate(ours), np.concatenate(ref)
    assert a.shape == b.shape
    assert np.isfinite(a).all(), "non-finite logprobs"
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    worst = float(np.abs(a - b).max())
    assert rel < tol.logprob_rel and worst < tol.logprob_abs, f"relative {rel:.2e}, worst position {worst:.2e}"


def _data(seed: int, lengths=(7, 20, 33)) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [sft_datum(random_tokens(rng, n + 1, VOCAB)) for n in lengths]


# ---------------------------------------------------------------------------------------- numerics
def test_forward_logprobs_match_cpu_fp32_reference(sc, base_model, tolerance):
    tc = lora_client(sc, base_model, rank=8, seed=3)
    data = _data(0)
    out = tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    _assert_close(logprobs_of(out), _reference(base_model, data), tolerance)


def test_second_base_model_trains_and_matches_its_reference(sc, second_base_model, tolerance):
    caps = sc.get_server_capabilities()
    assert second_base_model in {m.model_name for m in caps.supported_models}
    tc = lora_client(sc, second_base_model, rank=4, seed=1)
    data = _data(1)
    _assert_close(logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)),
                  _reference(second_base_model, data), tolerance)
    losses = train_steps(tc, repeated_pattern_batch(2, 4, 24, VOCAB), steps=6)
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not HAS_DTYPE_OPTION, reason="the server has no --dtype option (ServerConfig.dtype): "
                                                   "no fp32 mode on a GPU to check exactness in")
def test_fp32_mode_is_exact(make_gpu_server, base_model):
    import tinker

    srv = make_gpu_server(["--dtype", "float32"])
    client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-gpu-fp32")
    tc = lora_client(client, base_model, rank=8, seed=3)
    data = _data(4)
    _assert_close(logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)),
                  _reference(base_model, data), FP32)


# ---------------------------------------------------------------------------------------- sampling
def test_sampling_with_temperature_topk_topp_seed_stop_and_logprobs(sc, base_model):
    """Temperature > 0 crashed on CUDA once (per-row tensors built on the CPU): every option at once."""
    s = sc.create_sampling_client(base_model=base_model)
    prompt = types.ModelInput.from_ints(random_tokens(np.random.default_rng(5), 12, VOCAB))
    params = types.SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=1234, stop=[7, 11])
    r1 = s.sample(prompt, num_samples=4, sampling_params=params, topk_sample_logprobs=3).result(timeout=RESULT_TIMEOUT_S)
    r2 = s.sample(prompt, num_samples=4, sampling_params=params, topk_sample_logprobs=3).result(timeout=RESULT_TIMEOUT_S)
    assert len(r1.sequences) == 4
    for a, b in zip(r1.sequences, r2.sequences):
        assert a.tokens == b.tokens, "the same seed must give the same samples"
        assert 1 <= len(a.tokens) <= 16
        assert all(0 <= t < VOCAB for t in a.tokens)
        lp = np.asarray(a.logprobs)
        assert lp.shape == (len(a.tokens),) and np.isfinite(lp).all() and (lp <= 1e-4).all()
        if a.stop_reason == "stop":
            assert a.tokens[-1] in (7, 11)
        else:
            assert len(a.tokens) == 16 and not set(a.tokens) & {7, 11}
    # greedy sampling: deterministic without a seed
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    g = [s.sample(prompt, 1, greedy).result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens for _ in range(2)]
    assert g[0] == g[1]


def test_the_server_runs_its_decode_bursts_ahead_of_its_reads(sc, gpu_server, base_model):
    """On a GPU the server's samplers queue each decode burst before they read the last one
    (``--sampler-run-ahead``, on by default), as /metrics counts; a seeded request samples the same
    tokens again."""
    if DEVICE != "cuda":
        pytest.skip("samplers run ahead on CUDA only (a CPU does the host's work and the device's in turn)")
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def counters() -> dict[str, float]:
        text = httpx.get(f"{gpu_server.base_url}/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    s = sc.create_sampling_client(base_model=base_model)
    prompt = types.ModelInput.from_ints(random_tokens(np.random.default_rng(9), 20, VOCAB))
    params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=77, stop=[])
    before = counters()
    first = s.sample(prompt, num_samples=8, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    after = counters()
    again = s.sample(prompt, num_samples=8, sampling_params=params).result(timeout=RESULT_TIMEOUT_S)
    assert [q.tokens for q in first.sequences] == [q.tokens for q in again.sequences]
    assert all(len(q.tokens) == 64 for q in first.sequences)
    ahead = after["tinsmith_decode_bursts_ahead_total"] - before.get("tinsmith_decode_bursts_ahead_total", 0.0)
    reads = after["tinsmith_decode_reads_total"] - before.get("tinsmith_decode_reads_total", 0.0)
    assert 0 < ahead < reads, (ahead, reads)


def test_prompt_logprobs_and_topk_match_cpu_reference(sc, base_model, tolerance):
    s = sc.create_sampling_client(base_model=base_model)
    tokens = random_tokens(np.random.default_rng(6), 24, VOCAB)
    r = s.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1, temperature=1.0),
                 include_prompt_logprobs=True, topk_prompt_logprobs=5).result(timeout=RESULT_TIMEOUT_S)
    assert r.prompt_logprobs[0] is None
    ours = np.asarray(r.prompt_logprobs[1:], dtype=np.float64)
    ref = _reference(base_model, [sft_datum(tokens)])
    _assert_close([ours], ref, tolerance)
    for pos, top in enumerate(r.topk_prompt_logprobs[1:]):
        assert len(top) == 5
        lps = [lp for _, lp in top]
        assert lps == sorted(lps, reverse=True)
        assert lps[0] >= ours[pos] - tolerance.logprob_abs


def test_base_and_adapter_sampled_together(sc, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=9)
    train_steps(tc, repeated_pattern_batch(3, 4, 24, VOCAB), steps=3)
    tuned = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    base = sc.create_sampling_client(base_model=base_model)
    prompt = types.ModelInput.from_ints(random_tokens(np.random.default_rng(8), 10, VOCAB))
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    futures = [c.sample(prompt, 2, params) for c in (tuned, base, tuned, base)]
    for f in futures:
        seqs = f.result(timeout=RESULT_TIMEOUT_S).sequences
        assert len(seqs) == 2 and all(len(q.tokens) >= 1 for q in seqs)


# ---------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_run_and_are_finite(sc, base_model, loss_fn):
    tc = lora_client(sc, base_model, rank=4, seed=2)
    rng = np.random.default_rng(10)
    data = []
    for n in (9, 14):
        t = random_tokens(rng, n + 1, VOCAB)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                loss_fn_inputs={"target_tokens": t[1:], "logprobs": (-rng.random(n) * 3).tolist(),
                                                "advantages": rng.normal(size=n).tolist()}))
    out = tc.forward_backward(data, loss_fn).result(timeout=RESULT_TIMEOUT_S)
    tc.optim_step(ADAM).result(timeout=RESULT_TIMEOUT_S)
    assert np.isfinite(loss_sum(out))
    assert all(np.isfinite(lp).all() for lp in logprobs_of(out))


def test_sft_loss_falls(sc, base_model):
    tc = lora_client(sc, base_model, rank=8, seed=0)
    losses = train_steps(tc, repeated_pattern_batch(0, 8, 32, VOCAB), steps=8)
    assert losses[-1] < 0.7 * losses[0], losses


def test_custom_loss_through_forward_backward_custom(sc, base_model):
    tc = lora_client(sc, base_model, rank=4, seed=5)
    data = repeated_pattern_batch(1, 2, 16, VOCAB)

    def mean_logprob_loss(batch, logprobs):
        loss = -sum(lp.mean() for lp in logprobs) / len(logprobs)
        return loss, {"custom:mean": float(loss.detach())}

    forward = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    expected = -float(np.mean([lp.mean() for lp in forward]))
    out = tc.forward_backward_custom(data, mean_logprob_loss).result(timeout=RESULT_TIMEOUT_S)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3)
    tc.optim_step(ADAM).result(timeout=RESULT_TIMEOUT_S)
    after = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    assert -float(np.mean([lp.mean() for lp in after])) < expected


def test_four_tenants_in_one_batch_match_their_solo_results(sc, base_model, tolerance):
    clients = [lora_client(sc, base_model, rank=4, seed=20 + i) for i in range(4)]
    data = [_data(30 + i, lengths=(16, 24)) for i in range(4)]
    solo = [logprobs_of(c.forward(d, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)) for c, d in zip(clients, data)]
    futures = [c.forward_backward(d, "cross_entropy") for c, d in zip(clients, data)]
    together = [logprobs_of(f.result(timeout=RESULT_TIMEOUT_S)) for f in futures]
    for s, t in zip(solo, together):
        _assert_close(t, s, tolerance)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: c.optim_step(ADAM).result(timeout=RESULT_TIMEOUT_S), clients))


# ---------------------------------------------------------------------------------------- checkpoints
def test_save_load_resume_and_export(sc, gpu_server, base_model, tolerance, tmp_path):
    tc = lora_client(sc, base_model, rank=8, seed=4)
    batch = repeated_pattern_batch(4, 4, 24, VOCAB)
    train_steps(tc, batch, steps=3)
    state = tc.save_state("gpu-resume").result(timeout=RESULT_TIMEOUT_S).path
    weights = tc.save_weights_for_sampler("gpu-export").result(timeout=RESULT_TIMEOUT_S).path
    probe = _data(40)
    before = logprobs_of(tc.forward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    resumed = sc.create_training_client_from_state_with_optimizer(state).result(timeout=RESULT_TIMEOUT_S)
    _assert_close(logprobs_of(resumed.forward(probe, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)), before,
                  tolerance)
    # the next step from the resumed state is the next step of the original
    a = train_steps(tc, batch, steps=1)[0]
    b = train_steps(resumed, batch, steps=1)[0]
    assert b == pytest.approx(a, rel=tolerance.logprob_rel)
    out = tmp_path / "peft"
    proc = subprocess.run([sys.executable, "-m", "tinsmith.cli", "export", weights, "--out", str(out), "--format", "peft",
                           "--quiet", "--data-dir", str(gpu_server.data_dir)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
