"""Cancelling sampling requests: queued ones never run, running ones leave at the next decode step."""

from __future__ import annotations

import threading

import numpy as np

from tests.sampling.conftest import fresh_model, make_sampler, run, task
from tinsmith.sampling.cancel import CancelBoard, SampleCancelled


def _board() -> CancelBoard:
    return CancelBoard(key_id=lambda key: key)


def test_cancel_of_a_running_request_drops_it_at_the_next_decode_step(qwen3_dir):
    model = fresh_model(qwen3_dir)
    board = _board()
    sampler = make_sampler(model, qwen3_dir, cancellations=board)
    sampler.add(task("gone", [1, 2, 3], n=3, max_tokens=200, stop=[], seed=1))
    sampler.add(task("kept", [4, 5], n=1, max_tokens=12, stop=[], seed=2))
    assert sampler.step(1e-4) == []  # prefill + one decode step: 4 rows decode together
    assert len(sampler.rows) == 4 and sampler.cache.lengths[:4].min() > 0
    steps = sampler.stats["decode_steps"]
    # Post from another thread while the sampler is mid-decode: the next step has 1 row only.
    seen_rows: list[int] = []
    original = sampler._decode_step

    def decode_and_cancel(done):
        seen_rows.append(len(sampler.rows))
        if len(seen_rows) == 1:
            t = threading.Thread(target=board.post, args=("gone",))
            t.start()
            t.join()
        original(done)

    sampler._decode_step = decode_and_cancel
    done = dict(sampler.step(10.0))  # runs until "kept" finishes
    assert isinstance(done["gone"], SampleCancelled) and "cancelled" in done["gone"].message
    assert len(done["kept"].sequences[0].tokens) == 12
    assert seen_rows[0] == 4 and seen_rows[1:] and set(seen_rows[1:]) == {1}  # dropped right after
    assert sampler.stats["decode_steps"] - steps == len(seen_rows)
    assert sampler.rows == [] and not sampler.has_work()
    assert sampler.stats["cancelled"] == 1


def test_cancel_of_a_queued_request_never_prefills_it(qwen3_dir):
    model = fresh_model(qwen3_dir)
    board = _board()
    sampler = make_sampler(model, qwen3_dir, cancellations=board)
    board.post("q")
    out = run(sampler, [task("q", [1, 2], max_tokens=4, stop=[]), task("r", [3, 4], max_tokens=4, stop=[])])
    assert isinstance(out["q"], SampleCancelled)
    assert len(out["r"].sequences[0].tokens) == 4
    assert sampler.stats["prefills"] == 1


def test_a_forgotten_cancel_no_longer_matches_and_results_are_unchanged(qwen3_dir):
    model = fresh_model(qwen3_dir)
    board = _board()
    alone = run(make_sampler(model, qwen3_dir), [task("a", [5, 6, 7], max_tokens=8, stop=[], seed=3)])["a"]
    board.post("a")
    board.forget("a")
    sampler = make_sampler(model, qwen3_dir, cancellations=board)
    again = run(sampler, [task("a", [5, 6, 7], max_tokens=8, stop=[], seed=3)])["a"]
    np.testing.assert_array_equal(alone.sequences[0].tokens, again.sequences[0].tokens)
    assert len(board) == 0 and sampler.stats["cancelled"] == 0
