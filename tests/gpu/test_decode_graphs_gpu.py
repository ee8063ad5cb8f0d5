"""Decode steps replayed from CUDA graphs sample token for token what the same static step samples
launched eagerly, and (in fp32) what the eager decode path samples: seeded, greedy, top-k / top-p
rows, several adapters with base rows, rows joining and leaving, the cache growing (graphs
recaptured), and a new adapter growing the banks between requests (graphs recaptured), for a
dense model and a hybrid one (its Gated DeltaNet states advance in graph buffers). A
mixture-of-experts model is captured where the grouped matmul serves its experts (bf16 on Hopper);
in fp32 its expert loop reads the counts on the host, so its sampler decodes eagerly from the
start (no capture is tried) and samples the same."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import run_to_end
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models import moe
from tinsmith.models.loading import load_model
from tinsmith.sampling.decode_graphs import DecodeGraphs
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import SampleInput, SamplingParams

pytestmark = pytest.mark.gpu


def _tasks(slots):
    rng = np.random.default_rng(0)
    kinds = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20)]
    return [SampleTask(i, s, SampleInput(rng.integers(4, 500, 5 + 3 * i), 1 + i % 3,
                                         SamplingParams(max_tokens=40 + 17 * (i % 4), seed=i, stop=[], **kinds[i % 4]),
                                         topk_sample_logprobs=3 if i == 2 else 0))
            for i, s in enumerate(slots)]


def _sample(model, mode: str, rounds) -> tuple[list[dict], Sampler]:
    """``rounds``: (slots, adapter to install before) per round, run one after the other on one sampler."""
    sampler = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=(mode == "graphs"))
    if mode == "static-eager":
        sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    results = []
    for slots, new_adapter in rounds:
        if new_adapter is not None:
            random_adapter(model, new_adapter, rank=16, seed=new_adapter)
        results.append(run_to_end(sampler, _tasks(slots)))
    return results, sampler


@pytest.mark.parametrize("family, dtype", [("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                                           ("qwen3_5", torch.float32), ("qwen3_moe", torch.float32),
                                           ("qwen3_moe", torch.bfloat16)])
def test_graphed_decode_equals_eager_decode(family, dtype, tmp_path):
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("CUDA graphs exist only on CUDA devices")
    model_dir = make_tiny_model(tmp_path / family, family, SMALL, seed=1)
    # Adapters 1..3 at first; 4..7 arrive in the second round and outgrow the bank's 4 positions.
    rounds = [([1, None, 2, 3, 1, None], None),
              ([4, 5, 6, 7, 1, None, 2], 4)]
    got: dict[str, list[dict]] = {}
    for mode in ("eager", "static-eager", "graphs"):
        model = load_model(str(model_dir), device=DEVICE, dtype=dtype).model
        for slot, rank in ((1, 4), (2, 8), (3, 16)):
            random_adapter(model, slot, rank=rank, seed=slot)
        for slot in (5, 6, 7):
            random_adapter(model, slot, rank=4, seed=slot)
        got[mode], sampler = _sample(model, mode, rounds)
        if mode == "graphs":
            stats = sampler.stats
            # Hybrids' recurrent states are graph buffers too; routed experts are captured where the
            # grouped matmul serves them (bf16 on Hopper), their loop reads expert counts on the host.
            x = torch.empty(1, device=DEVICE, dtype=dtype)
            if family in ("qwen3", "qwen3_5") or moe.grouped_mm_fits(x, dtype, SMALL.moe_intermediate_size,
                                                                       SMALL.hidden_size):
                assert stats["static_steps"] == stats["decode_steps"], stats
                assert stats["graph_replays"] > stats["graph_captures"] >= 3, stats  # recaptured, then replayed
            else:  # known before any capture is tried: every step eager
                assert moe.capture_blocker(model) is not None
                assert sampler.graphs is None
                assert not any(stats.get(k) for k in ("graph_replays", "graph_captures", "static_steps")), stats
    for ref_round, graph_round, static_round in zip(got["eager"], got["graphs"], got["static-eager"]):
        for key, ref in ref_round.items():
            for a, b, c in zip(ref.sequences, graph_round[key].sequences, static_round[key].sequences):
                # A replay runs the kernels the static step launches (cuBLAS may pick another
                # algorithm under capture: logprobs to rounding, tokens the same).
                assert b.tokens.tolist() == c.tokens.tolist(), key
                tol = 1e-6 if dtype == torch.float32 else 1e-3
                np.testing.assert_allclose(b.logprobs, c.logprobs, rtol=tol, atol=tol)
                if dtype == torch.float32:  # padded shapes may round differently: fp32 keeps the tokens
                    assert a.tokens.tolist() == b.tokens.tolist(), key
                    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)


def test_a_kept_idle_cache_replays_the_last_phase_graphs(tmp_path):
    """An RL loop's second sampling phase on a sampler that keeps its cache when idle (the server's
    choice on GPUs) replays the graphs of the first, capturing none, and samples what a sampler
    that gave its memory back samples (tests/sampling/test_paged_kv_cache.py checks the giving back)."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("CUDA graphs exist only on CUDA devices")
    model = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), DEVICE, torch.float32).model
    phase = lambda: _tasks([None] * 6)  # noqa: E731
    keeping = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=True, keep_cache_when_idle=True)
    giving = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=True)
    for sampler in (keeping, giving):
        run_to_end(sampler, phase())
    captured = keeping.stats["graph_captures"]
    assert captured > 0
    got, want = run_to_end(keeping, phase()), run_to_end(giving, phase())
    assert keeping.stats["graph_captures"] == captured, "the second phase captured graphs again"
    for key, res in want.items():
        for a, b in zip(res.sequences, got[key].sequences):
            assert a.tokens.tolist() == b.tokens.tolist(), key


def test_running_ahead_replays_what_reading_every_burst_replays(tmp_path):
    """The server's sampler queues its next burst of graph replays before it reads the last one
    (``run_ahead``, on by default on a GPU): the same tokens and stop reasons, logprobs equal to
    rounding (the cache may grow a burst earlier, and a step over a larger capacity may sum its
    attention in another order)."""
    dtype = torch.float32
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("CUDA graphs exist only on CUDA devices")
    model = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), DEVICE, dtype).model
    for slot, rank in ((1, 4), (2, 8), (3, 16)):
        random_adapter(model, slot, rank=rank, seed=slot)
    got = {}
    for ahead in (False, True):
        sampler = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=True, run_ahead=ahead)
        got[ahead] = run_to_end(sampler, _tasks([1, None, 2, 3, 1, None]))
        assert (sampler.stats["bursts_ahead"] > 0) == ahead
        assert sampler.stats["graph_replays"] > 0
    for key, res in got[False].items():
        for a, b in zip(res.sequences, got[True][key].sequences, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist(), key
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5, err_msg=key)
            assert a.stop_reason == b.stop_reason, key


def test_a_burst_read_waits_for_that_burst_only():
    """What running ahead rests on: reading a burst's outputs (``HostCopies``) waits for the work
    queued before them, not for the next burst queued after them."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("needs a CUDA stream to queue work behind the copies")
    from tinsmith.transfers import HostCopies

    x = torch.arange(1000, device=DEVICE, dtype=torch.float32)
    torch.cuda.synchronize()
    copies = HostCopies([x.sum(), x[:3]])
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 31)  # about a second of the device spinning, queued behind the copies
    end.record()
    t = time.perf_counter()
    got = copies.lists()
    waited = time.perf_counter() - t
    torch.cuda.synchronize()
    busy = start.elapsed_time(end) / 1e3
    assert got == [499500.0, [0.0, 1.0, 2.0]]
    assert busy > 0.2, "the queued work was too short to tell"
    assert waited < busy / 4, f"the read waited {waited:.3f} s of the {busy:.3f} s queued after it"


def test_queuing_bursts_waits_for_no_device_work(tmp_path, monkeypatch):
    """The host queues a slice's bursts (graph replays over paged K/V, rows of two adapters and
    the base model, new pages taken as rows cross into them, the next burst queued ahead of its
    read) without waiting for anything queued on the device before them: between the slice's
    start and its first read-back the host never stops for the device (a wait there empties the
    launch queue every burst). On the CPU (``TINSMITH_GPU_TEST_DEVICE=cpu``) the same slice runs
    eagerly over paged K/V and only what it does is checked, not its timing."""
    from tinsmith.sampling.paged_kv_cache import PagedKVCache
    from tinsmith.transfers import HostCopies

    cuda = torch.device(DEVICE).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(str(make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)), DEVICE, dtype).model
    for slot, rank in ((1, 8), (2, 16)):
        random_adapter(model, slot, rank=rank, seed=slot)
    sampler = Sampler(model, lambda t: "", max_rows=8, cuda_graphs=cuda, kv_layout="paged", decode_burst=4,
                      run_ahead=True)
    rng = np.random.default_rng(0)

    def tasks(first: int) -> list[SampleTask]:  # prompts of 54..59 tokens: rows cross into a new page soon
        return [SampleTask(first + i, [None, 1, 2][i % 3],
                           SampleInput(rng.integers(4, 500, 54 + i), 1,
                                       SamplingParams(max_tokens=120, temperature=1.0, seed=i, stop=[])))
                for i in range(6)]

    run_to_end(sampler, tasks(0))  # the page pool grown past these rows' needs, the bucket's graphs captured
    for t in tasks(100):
        sampler.add(t)
    sampler.step(0.0)  # admitted and prefilled; a first burst decoded
    events: list[tuple[str, float]] = []
    read, write = HostCopies.lists, PagedKVCache._write_table

    def lists(self):
        events.append(("read", time.perf_counter()))
        return read(self)

    def write_table(self, rows, cols, pages):
        if pages:
            events.append(("new pages", time.perf_counter()))
        return write(self, rows, cols, pages)

    monkeypatch.setattr(HostCopies, "lists", lists)
    monkeypatch.setattr(PagedKVCache, "_write_table", write_table)
    captures = sampler.stats.get("graph_captures", 0)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1 << 31)  # about a second of the device spinning, queued before the slice
        end.record()
    t = time.perf_counter()
    sampler.step(0.5)
    kinds = [kind for kind, _ in events]
    assert "read" in kinds, "the slice read no burst"
    first_read = next(at for kind, at in events if kind == "read")
    assert "new pages" in kinds[:kinds.index("read")], f"no row crossed into a new page before the first read: {kinds}"
    assert sampler.stats["bursts_ahead"] > 0 and sampler.stats.get("graph_captures", 0) == captures
    if cuda:
        torch.cuda.synchronize()
        busy = start.elapsed_time(end) / 1e3
        assert busy > 0.2, "the queued work was too short to tell"
        assert first_read - t < busy / 4, f"queuing the bursts waited {first_read - t:.3f} s of the {busy:.3f} s before them"
    sampler.abort()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_on_the_device_equal_the_computed_turns(dtype):
    """A decode step's turns come from tables made on the device (tinsmith.models.layers.Rotary):
    bit for bit what computing them there gives, for the positions decode steps take."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("the CPU's tables are held to the same by tests/models/test_rotary_tables.py")
    from tinsmith.models.config import RopeConfig
    from tinsmith.models.layers import Rotary

    for rope in (RopeConfig(theta=1e6), RopeConfig(kind="yarn", factor=4.0, original_max_position_embeddings=4096)):
        rotary = Rotary(128, rope, max_positions=40960).to(DEVICE)
        positions = torch.randint(0, 40960, (256, 1), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
        for computed, tabled in zip(rotary(positions, dtype), rotary(positions, dtype, tabled=True)):
            assert tabled.device == computed.device and torch.equal(tabled, computed)


def test_the_steps_row_bookkeeping_kernel_equals_torch_and_replays():
    """A decode step's positions, key counts, pages and offsets (tinsmith.kernels.step_rows) on the
    device, launched and replayed from a graph after the lengths moved, equal the torch ops'."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("the CPU runs the kernel in Triton's interpreter: tests/kernels/test_step_rows.py")
    from tinsmith.kernels import step_rows
    from tinsmith.sampling.kv_cache import StepRows

    g = torch.Generator(DEVICE).manual_seed(0)
    n, width, page = 256, 40, 64
    lengths = torch.randint(0, width * page, (n + 8,), device=DEVICE, generator=g)
    live = (torch.rand(n, device=DEVICE, generator=g) < 0.8).long()
    rope = torch.randint(0, 30, (n,), device=DEVICE, generator=g)
    table = torch.randint(1, 9000, (n + 8, width), device=DEVICE, generator=g, dtype=torch.int32)

    def outputs(r: StepRows) -> list[torch.Tensor]:
        return [r.pos, r.seen(), r.positions, *r.slots()]

    def reference() -> list[torch.Tensor]:
        kept, step_rows.BACKEND = step_rows.BACKEND, "torch"
        try:
            return [t.clone() for t in outputs(StepRows(lengths, n, live, rope, table[:n], page, 0))]
        finally:
            step_rows.BACKEND = kept

    assert step_rows.usable(lengths)
    for got, want in zip(outputs(StepRows(lengths, n, live, rope, table[:n], page, 0)), reference()):
        assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        StepRows(lengths, n, live, rope, table[:n], page, 0)  # built outside the capture first
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = outputs(StepRows(lengths, n, live, rope, table[:n], page, 0))
    lengths.add_(live.new_ones(n + 8))  # the next step's lengths, in place
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, reference()):
        assert torch.equal(got, want)
