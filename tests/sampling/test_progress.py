"""Progress reports of running sequences (what streamed responses are built from)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.sampling.conftest import task
from tinsmith.server.operations import WorkerOperations


def test_running_sequences_are_reported_between_steps_as_prefixes_of_the_result(sampler):
    reports: list[tuple[int, list[int]]] = []
    job = SimpleNamespace(request_id="r1", args=SimpleNamespace(progress=lambda i, toks: reports.append((i, list(toks)))))
    sampler.add(task(job, [5, 6, 7, 8], n=2, max_tokens=12, temperature=0.0, stop=[]))
    done = []
    for _ in range(10_000):
        if not sampler.has_work():
            break
        done += sampler.step(budget_s=0.002)
        WorkerOperations._report_progress(sampler)
    ((key, result),) = done
    assert key is job
    finals = [s.tokens.tolist() for s in result.sequences]
    assert reports, "no progress was reported while the sequences decoded"
    for i, toks in reports:
        assert 0 < len(toks) < 12 and finals[i][: len(toks)] == toks
    assert {i for i, _ in reports} == {0, 1}


def test_a_failing_listener_does_not_stop_the_batch(sampler):
    def boom(i, toks):
        raise RuntimeError("listener gone")

    job = SimpleNamespace(request_id="r2", args=SimpleNamespace(progress=boom))
    other = SimpleNamespace(request_id="r3", args=SimpleNamespace(progress=None))
    sampler.add(task(job, [5, 6], max_tokens=6, temperature=0.0, stop=[]))
    sampler.add(task(other, [7, 8], max_tokens=6, temperature=0.0, stop=[]))
    done = []
    for _ in range(10_000):
        if not sampler.has_work():
            break
        done += sampler.step(budget_s=0.002)
        WorkerOperations._report_progress(sampler)
    assert {id(k) for k, _ in done} == {id(job), id(other)}
    assert all(len(r.sequences[0].tokens) == 6 for _, r in done)
