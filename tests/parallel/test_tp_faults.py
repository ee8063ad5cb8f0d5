"""A rank that raises, exits or stalls makes the other rank's call fail with a clear error within
the group's timeout instead of hanging."""

from __future__ import annotations

import pytest

from tests.parallel.scenario import assert_peer_fault_fails_rank0, faulty_rank_main

TIMEOUT_S = 3.0


@pytest.mark.parametrize("fault", ["raise", "exit", "stall"])
def test_peer_fault_fails_the_other_rank(qwen3_dir, tmp_path, fault):
    got = assert_peer_fault_fails_rank0(faulty_rank_main, qwen3_dir, tmp_path, fault, TIMEOUT_S)
    assert "another rank exited, raised or did not join" in got["message"]
