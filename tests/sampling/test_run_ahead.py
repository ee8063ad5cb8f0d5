"""Running ahead: the sampler queues its next decode burst before it reads the last one's tokens
(what a GPU needs to decode while the host records them). Results equal reading every burst
before queueing the next: same tokens, stop reasons and top-k ids, logprobs equal up to float
rounding, on the eager step and the static one (what CUDA graphs record), with stop tokens,
stop strings and max_tokens ending rows inside the queued-ahead burst, rows joining as others
leave, adapters, seeds and greedy rows. It never runs ahead while requests wait, and a burst's
read waits for that burst only (checked on a GPU in tests/gpu/test_decode_graphs_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sampling.conftest import decoder, fresh_model, mixed_tasks, random_adapter, run, task
from tinsmith.models import lora as lora_mod
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.sampling.sampler import Sampler
from tinsmith.transfers import HostCopies


def _tasks(vocab: int):
    return mixed_tasks(vocab, seed=3, stop_share=20, late=True)


def _sample(model_dir, *, ahead: bool, static: bool, max_rows: int, tasks=None, layout: str = "auto"):
    model = fresh_model(model_dir)
    random_adapter(model, 1, seed=1)
    random_adapter(model, 2, rank=8, seed=2)
    sampler = Sampler(model, decoder(model_dir), decode_burst=3, max_rows=max_rows, run_ahead=ahead,
                      kv_layout=layout)
    if static:
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    # A budget long enough that a step's bursts run back to back (ahead when allowed).
    return run(sampler, tasks or _tasks(model.config.vocab_size), budget_s=5.0), sampler


def _assert_same(ref: dict, got: dict) -> set[str]:
    reasons = set()
    for key, res in ref.items():
        assert not isinstance(res, Exception), res
        assert not isinstance(got[key], Exception), got[key]
        for a, b in zip(res.sequences, got[key].sequences, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6, err_msg=key)
            assert a.stop_reason == b.stop_reason, key
            reasons.add(a.stop_reason)
            if a.topk_token_ids is not None:
                np.testing.assert_array_equal(a.topk_token_ids, b.topk_token_ids)
                np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=1e-5, atol=1e-6)
    return reasons


@pytest.mark.parametrize("static, layout", [(False, "rows"), (True, "rows"), (True, "paged")],
                         ids=["eager", "static", "static-paged"])
@pytest.mark.parametrize("max_rows", [16, 5], ids=["all-rows", "rows-join-later"])
def test_running_ahead_samples_what_reading_every_burst_samples(qwen3_dir, monkeypatch, static, layout, max_rows):
    """Rows ending by a stop inside a burst leave while the next burst is queued (their cache rows
    move or give their pages back behind it, the batch's tensors are gathered from its outputs)."""
    if static:
        monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")  # the static step's layout, on both sides
    ref, plain = _sample(qwen3_dir, ahead=False, static=static, max_rows=max_rows, layout=layout)
    got, ahead = _sample(qwen3_dir, ahead=True, static=static, max_rows=max_rows, layout=layout)
    assert _assert_same(ref, got) == {"stop", "length"}
    assert plain.stats["bursts_ahead"] == plain.stats["rows_left_ahead"] == 0
    assert ahead.stats["bursts_ahead"] > 0
    if max_rows == 16:  # every request decodes from the start: nothing waits, rows end while one is queued
        assert ahead.stats["rows_left_ahead"] > 0
    # Bursts queued ahead of rows that ended are the only extra decode steps.
    assert ahead.stats["decode_steps"] >= plain.stats["decode_steps"]
    assert not ahead.rows


def test_a_hybrid_model_runs_ahead_too(qwen3_5_dir, monkeypatch):
    """Qwen3.5's Gated DeltaNet states are per-row buffers the step advances: rows leaving while a
    burst is queued move their states behind it, as their K/V."""
    monkeypatch.setattr(lora_mod, "DECODE_LORA", "bank")
    ref, _ = _sample(qwen3_5_dir, ahead=False, static=True, max_rows=16)
    got, ahead = _sample(qwen3_5_dir, ahead=True, static=True, max_rows=16)
    _assert_same(ref, got)
    assert ahead.stats["rows_left_ahead"] > 0


def test_stop_strings_end_rows_inside_a_burst_queued_ahead(qwen3_dir):
    """A stop string is found on the host as tokens are recorded, a burst later than the device
    decoded them when running ahead: the sequence still ends where reading every burst ends it."""
    model = fresh_model(qwen3_dir)
    text = decoder(qwen3_dir)
    probe = Sampler(model, text, decode_burst=3, run_ahead=False)
    free = run(probe, [task("free", [5, 9, 13, 2], n=2, max_tokens=40, temperature=1.0, seed=11, stop=[])])
    seq = free["free"].sequences[0].tokens.tolist()
    # A stop string that the first sequence meets a dozen tokens in.
    stop = text(seq[:12])[-3:]
    assert stop
    tasks = [task("strings", [5, 9, 13, 2], n=2, max_tokens=40, temperature=1.0, seed=11, stop=[stop]),
             task("other", [7, 7, 3], max_tokens=37, temperature=1.0, seed=12, stop=[])]
    ref = run(Sampler(fresh_model(qwen3_dir), text, decode_burst=3, run_ahead=False), tasks, budget_s=5.0)
    sampler = Sampler(fresh_model(qwen3_dir), text, decode_burst=3, run_ahead=True)
    got = run(sampler, tasks, budget_s=5.0)
    assert "stop" in _assert_same(ref, got)
    assert sampler.stats["bursts_ahead"] > 0


def test_no_running_ahead_while_requests_wait_or_outside_a_step(qwen3_dir, monkeypatch):
    """Waiting requests are admitted between bursts as before: while any waits, the sampler reads
    each burst before queueing the next; once none waits, it runs ahead."""
    model = fresh_model(qwen3_dir)
    sampler = Sampler(model, decoder(qwen3_dir), decode_burst=2, max_rows=2, run_ahead=True)
    launches: list[tuple[int, int]] = []  # (requests waiting, tokens pending) at each burst queued
    launch = sampler._launch_burst

    def counted(pending: int):
        launches.append((len(sampler.inbox), pending))
        return launch(pending)

    monkeypatch.setattr(sampler, "_launch_burst", counted)
    for i in range(4):
        sampler.add(task(f"r{i}", [4 + i, 8, 9], max_tokens=12, temperature=1.0, seed=i, stop=[]))
    with torch.inference_mode():
        sampler._admit([])
        assert sampler.inbox, "two requests wait for rows"
        sampler._decode_step([])  # outside step(): no time slice, so nothing runs ahead
    assert launches == [(2, 0)] and sampler.stats["bursts_ahead"] == 0
    while sampler.has_work():
        sampler.step(budget_s=5.0)
    assert not [w for w, pending in launches if w and pending], "ran ahead while requests waited"
    assert any(pending for _, pending in launches) and sampler.stats["bursts_ahead"] > 0


def test_requests_arriving_outside_end_the_slice_after_one_burst(qwen3_dir):
    """The engine hands requests to the sampler between slices: while ``arrivals`` says some wait,
    a slice ends after the burst under way, none queued ahead of it, so they join after a burst
    rather than after the rest of the slice. Without arrivals the slice runs its bursts ahead."""
    model = fresh_model(qwen3_dir)
    sampler = Sampler(model, decoder(qwen3_dir), decode_burst=2, max_rows=4, run_ahead=True)
    for i in range(2):
        sampler.add(task(f"r{i}", [4 + i, 8, 9], max_tokens=40, temperature=1.0, seed=i, stop=[]))
    assert sampler.step(budget_s=60.0, arrivals=lambda: True) == []  # requests wait from the start
    assert sampler.stats["decode_reads"] == 1 and sampler.stats["bursts_ahead"] == 0
    asked = []

    def arrivals() -> bool:  # a request arrives while the slice's second burst is queued
        asked.append(1)
        return len(asked) > 1

    assert sampler.step(budget_s=60.0, arrivals=arrivals) == []
    assert sampler.stats["decode_reads"] == 3 and sampler.stats["bursts_ahead"] == 1
    assert sampler.stats["slices_ended_for_arrivals"] == 2
    sampler.add(task("late", [7, 8], max_tokens=1, temperature=1.0, seed=9, stop=[]))  # the engine hands it over
    done = dict(sampler.step(budget_s=60.0, arrivals=lambda: False))  # nothing more arrives: ahead to the end
    assert set(done) == {"r0", "r1", "late"} and sampler.stats["bursts_ahead"] > 1
    assert sampler.stats["slices_ended_for_arrivals"] == 2


def test_rows_ending_by_length_ride_along_and_cost_no_extra_step(qwen3_dir):
    """Where rows end is known on the host when only max_tokens ends them: a row whose last token
    is in the queued burst rides along in the next (its tokens past the end dropped), and nothing
    is queued once every row's end is queued, so running ahead decodes exactly the steps that
    reading every burst decodes."""
    tasks = [task(f"r{i}", [4 + i, 8, 9, 10], n=2, max_tokens=m, temperature=1.0, seed=i, stop=[])
             for i, m in enumerate((19, 19, 11, 26, 14))]
    ref, plain = _sample(qwen3_dir, ahead=False, static=False, max_rows=16, tasks=tasks)
    got, ahead = _sample(qwen3_dir, ahead=True, static=False, max_rows=16, tasks=tasks)
    assert _assert_same(ref, got) == {"length"}
    assert ahead.stats["bursts_ahead"] > 0 and ahead.stats["rows_left_ahead"] > 0
    assert ahead.stats["decode_steps"] == plain.stats["decode_steps"]


def test_host_copies_read_what_the_tensors_hold():
    a, b = torch.arange(6).reshape(2, 3), torch.tensor([0.5, -1.0])
    assert HostCopies([a, b]).lists() == [[[0, 1, 2], [3, 4, 5]], [0.5, -1.0]]


def test_the_server_option_turns_running_ahead_off(qwen3_dir):
    """``--sampler-run-ahead`` (on) leaves the choice to the device: on a GPU, not on a CPU;
    ``--no-sampler-run-ahead`` turns it off everywhere."""
    from tinsmith.worker.service import RuntimeOptions, sampler_kwargs_of

    on, off = sampler_kwargs_of(RuntimeOptions()), sampler_kwargs_of(RuntimeOptions(sampler_run_ahead=False))
    assert on["run_ahead"] is None and off["run_ahead"] is False
    assert not Sampler(fresh_model(qwen3_dir), decoder(qwen3_dir), run_ahead=on["run_ahead"]).run_ahead  # a CPU
