"""A local tensor-parallel group driven from this process (rank 0 here, rank 1 a child process):
training calls and sampling through it match one process, and a follower that dies leaves the
group unhealthy with the next call failing fast instead of hanging."""

from __future__ import annotations

import time

import pytest

from tests.parallel.scenario import assert_group_matches, group_reference, make_data
from tinsmith.parallel.group import ParallelError
from tinsmith.parallel.worker import LocalTPGroup
from tinsmith.types import ForwardBackwardInput
from tinsmith.worker.runtime import TrainRequest

TIMEOUT_S = 10.0


def test_local_group_matches_one_process_and_reports_a_dead_follower(qwen3_dir):
    ref = group_reference(str(qwen3_dir))
    vocab = ref.vocab
    group = LocalTPGroup(str(qwen3_dir), 2, timeout_s=TIMEOUT_S, runtime_kwargs={"logit_chunk_bytes": 4 * vocab * 5})
    try:
        assert_group_matches(group, ref)

        group.procs[0].kill()
        group.procs[0].join()
        assert not group.healthy
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="rank 1 of 2 .* exited"):
            group.call("train", "forward_backward", [TrainRequest(0, ForwardBackwardInput(make_data(1, [5], vocab), "cross_entropy"))])
        assert time.monotonic() - t0 < TIMEOUT_S + 5.0
        with pytest.raises(ParallelError, match="group is down"):
            group.call("train", "unit", 0)
    finally:
        group.close()
