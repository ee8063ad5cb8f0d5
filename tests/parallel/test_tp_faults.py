"""A rank that raises, exits or stalls makes the other rank's call fail with a clear error within
the group's timeout instead of hanging."""

from __future__ import annotations

import pytest

from tests.parallel.scenario import faulty_rank_main
from tinsmith.parallel.launch import run_ranks

TIMEOUT_S = 3.0


@pytest.mark.parametrize("fault", ["raise", "exit", "stall"])
def test_peer_fault_fails_the_other_rank(qwen3_dir, tmp_path, fault):
    outcomes = run_ranks(faulty_rank_main, 2, tmp_path, (str(qwen3_dir), fault, 1.5 * TIMEOUT_S),
                         timeout_s=TIMEOUT_S, deadline_s=60)
    rank0, rank1 = outcomes
    assert rank0.exitcode == 0, rank0.error
    got = rank0.result
    assert got["type"] == "ParallelError", got
    assert "rank 0 of 2" in got["message"] and "another rank exited, raised or did not join" in got["message"]
    assert got["elapsed"] < TIMEOUT_S + 4.0, got  # slack for a loaded machine
    if fault == "raise":
        assert "rank 1 fails on purpose" in rank1.error
    elif fault == "exit":
        assert rank1.exitcode == 3
