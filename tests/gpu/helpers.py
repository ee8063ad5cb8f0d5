"""What several GPU-tier tests do: run a sampler to the end, and compare a kernel with its torch path."""

from __future__ import annotations

import numpy as np
import torch

from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams


def graphed(fn, times: int = 1) -> tuple[torch.cuda.CUDAGraph, list]:
    """``fn()`` run once on a side stream (compiling and warming it outside the capture, as a
    sampler's first step does), then ``times`` calls of it captured in one CUDA graph, not run:
    ``(graph, the captured calls' outputs)``, which each replay fills."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = [fn() for _ in range(times)]
    return graph, outs


def assert_repeats_bit_for_bit(fn, want: torch.Tensor, eager: int, captured: int, replays: int) -> None:
    """``fn()`` (a kernel that sums split partials by tickets) equals ``want`` bit for bit ``eager``
    times launched and ``replays`` times replayed from a graph of ``captured`` calls, and leaves the
    device's tickets at zero after each way."""
    from tinsmith.kernels import tickets

    for _ in range(eager):
        assert torch.equal(fn(), want)
    assert not tickets.counters(want.device).any()
    graph, outs = graphed(fn, times=captured)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs)
    assert not tickets.counters(want.device).any()


def run_to_end(sampler: Sampler, tasks: list[SampleTask]) -> dict:
    """Queue ``tasks`` and step until every one finished; key -> result (none may fail)."""
    for t in tasks:
        sampler.add(t)
    out = {}
    while sampler.has_work():
        for key, res in sampler.step(1.0):
            assert not isinstance(res, Exception), res
            out[key] = res
    return out


def assert_kernel_samples_as_torch(model, kernels, lengths: list[int], max_tokens: int, monkeypatch) -> None:
    """The sampler through ``kernels`` (a module with a ``BACKEND`` switch) samples what it samples
    through torch: seeded rows of prompts of ``lengths``, 2 samples each, fp32 on the device
    (tokens equal, logprobs within 1e-3: the two sum in other orders)."""
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(kernels, "BACKEND", backend)
        rng = np.random.default_rng(0)
        tasks = [SampleTask(i, None, SampleInput(rng.integers(4, 500, n), 2, SamplingParams(
            max_tokens=max_tokens, temperature=0.9, seed=i, stop=[]))) for i, n in enumerate(lengths)]
        results[backend] = run_to_end(Sampler(model, lambda t: ""), tasks)
    for key, res in results["torch"].items():
        for a, b in zip(res.sequences, results["triton"][key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            assert np.abs(a.logprobs - b.logprobs).max() < 1e-3, key
