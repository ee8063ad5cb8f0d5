"""A local tensor-parallel group driven from this process (rank 0 here, rank 1 a child process):
training calls and sampling through it match one process, and a follower that dies leaves the
group unhealthy with the next call failing fast instead of hanging."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.parallel.scenario import assert_same, build_runtime, make_data, spmd_calls
from tinsmith.parallel.group import ParallelError
from tinsmith.parallel.worker import LocalTPGroup
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import ForwardBackwardInput, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainRequest

TIMEOUT_S = 10.0


def _tasks(vocab: int) -> list[SampleTask]:
    g = np.random.default_rng(6)
    return [SampleTask("base", None, SampleInput(g.integers(0, vocab, 6), 1, SamplingParams(max_tokens=5, temperature=0.0, stop=[]),
                                                 prompt_logprobs=True)),
            SampleTask("trained", 0, SampleInput(g.integers(0, vocab, 4), 2,
                                                 SamplingParams(max_tokens=5, temperature=1.0, seed=2, stop=[])))]


def _summary(done: list) -> dict:
    out = {}
    for key, res in done:
        assert not isinstance(res, Exception), res
        out[key] = [(s.tokens.astype(np.int64), s.logprobs) for s in res.sequences]
        if res.prompt_logprobs is not None:
            out[key + ":prompt"] = res.prompt_logprobs[1:]
    return out


def test_local_group_matches_one_process_and_reports_a_dead_follower(qwen3_dir):
    rt = build_runtime(str(qwen3_dir), None)
    vocab = rt.config.vocab_size
    plain = {"export_full_state": lambda u: rt.unit(u).export_state(),
             "import_full_state": lambda u, w, o: rt.unit(u).import_state(w, o)}
    ref = spmd_calls(lambda m, *a, **k: (plain[m] if m in plain else getattr(rt, m))(*a, **k), vocab)
    sampler = Sampler(rt.model, lambda ids: "")
    for t in _tasks(vocab):
        sampler.add(t)
    done = []
    while sampler.has_work():
        done += sampler.step(budget_s=float("inf"))
    ref_samples = _summary(done)

    group = LocalTPGroup(str(qwen3_dir), 2, timeout_s=TIMEOUT_S, runtime_kwargs={"logit_chunk_bytes": 4 * vocab * 5})
    try:
        got = spmd_calls(lambda m, *a, **k: group.call("train", m, *a, **k), vocab)
        assert group.healthy  # refused requests and a missing unit do not break the group
        assert_same(ref, got)
        assert_same(ref_samples, _summary(group.call("sample", _tasks(vocab))))

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
