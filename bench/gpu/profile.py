"""Where a step's device time goes: the kernels of a decode step and of a LoRA training step
(one tenant, then four in one step), read with ``torch.profiler``.

Device time is short, so the call that measures a figure also says why it is what it is. Each
item reports, per step: ``device_ms`` (the kernels' summed durations: what the step costs once
launches are free, as under CUDA graphs), ``wall_ms`` (the profiled step's wall time, launches
and profiler included), ``kernels`` (how many ran), those milliseconds by family (matmul,
attention, sort/scan, copies and indexing, the rest), and the most expensive kernels. On a CPU
(``--device cpu``) the same tables list the ATen operators' own CPU time instead.

The decode step is profiled eagerly (no graphs): its kernels are the graphs' kernels, each named.
:func:`decode_replayed` profiles the server's own path, steps replayed from CUDA graphs, where the
wall time per step against the kernels' says how long the device waits for the host; the host's
share is broken down by function (cProfile) beside it.
"""

from __future__ import annotations

import cProfile
import pstats
import re
import time

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from bench.gpu.peak import sync
from bench.gpu.train import RANK, batch, training_step
from tinsmith.models.loading import load_model
from tinsmith.sampling.decode_graphs import DecodeGraphs, bucket_for
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime

TOP = 15
# First match wins; names are CUDA kernels (cuBLAS / CUTLASS / Triton / ATen) or, on a CPU, ATen ops.
FAMILIES = (
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|grouped_mm|aten::(mm|bmm|addmm|matmul|linear)\b", re.I)),
    ("attention", re.compile(r"attention|flash|fmha|sdpa|_split_kernel|_combine_kernel|decode_attn", re.I)),
    ("sort/scan", re.compile(r"sort|scan|cumsum|radix|topk|searchsorted", re.I)),
    ("copy/index", re.compile(r"memcpy|memset|copy|index|gather|scatter|cat_|aten::(cat|to|_to_copy|clone)\b", re.I)),
)


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if pattern.search(name)), "other")


def kernel_table(prof, steps: int, wall_s: float) -> dict:
    """Per step: device ms, wall ms, kernel count, ms by family, the ``TOP`` kernels (name, ms, calls).
    ``steps`` is reported as counted; a profile of no step is divided by one."""
    counted, steps = steps, max(steps, 1)
    events = list(prof.key_averages())
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
               and not _annotation(e)]
    if kernels:
        rows = [(e.key, e.self_device_time_total, e.count) for e in kernels]
        source = "cuda kernels"
    else:  # a CPU run: ATen operators' own time
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in events
                if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
        source = "cpu aten ops"
    total_us = sum(us for _, us, _ in rows)
    families: dict[str, float] = {}
    for name, us, _ in rows:
        families[family(name)] = families.get(family(name), 0.0) + us / 1e3 / steps
    top = sorted(rows, key=lambda r: -r[1])[:TOP]
    return {"source": source, "steps": counted, "device_ms": total_us / 1e3 / steps, "wall_ms": 1e3 * wall_s / steps,
            "kernels": sum(c for _, _, c in rows) / steps,
            "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "top": [[name[:90], round(us / 1e3 / steps, 3), round(c / steps, 1)] for name, us, c in top],
            **(_idle(prof, steps) if kernels else {})}


def _annotation(e) -> bool:
    """A range the profiler draws on the device's timeline for a host annotation (an optimizer's
    step), not a kernel: counted, it would add its kernels' time twice."""
    return bool(getattr(e, "is_user_annotation", False)) or "#" in e.key or e.key.startswith("ProfilerStep")


def _idle(prof, steps: int, short_us: float = 10.0, where: int = 5) -> dict:
    """Per step, the device's idle time between its first and last kernel: gaps of at most
    ``short_us`` (a kernel waiting for the one before it to drain and the next to start: inside a
    CUDA graph, launches cost nothing else) and longer ones (the device waiting for the host's
    launches or its reads), and how many of those; and where the longer ones fall: the ``where``
    pairs of kernels (the one before a gap, the one after) with the most idle time between them,
    which tell a wait between graph replays or bursts from a wait inside a step."""
    spans = sorted((e.time_range.start, e.time_range.end, e.key) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not _annotation(e) and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    short = long = 0.0
    count = 0
    between: dict[tuple[str, str], list[float]] = {}  # (kernel before, kernel after) -> [idle us, gaps]
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        gap = start - end
        if gap > short_us:
            long, count = long + gap, count + 1
            tally = between.setdefault((last[:60], name[:60]), [0.0, 0])
            tally[0] += gap
            tally[1] += 1
        elif gap > 0:
            short += gap
        if stop >= end:
            end, last = stop, name
    worst = sorted(between.items(), key=lambda kv: -kv[1][0])[:where]
    return {"span_ms": (end - spans[0][0]) / 1e3 / steps, "idle_short_ms": short / 1e3 / steps,
            "idle_long_ms": long / 1e3 / steps, "long_idles": count / steps,
            "long_idles_between": [[before, after, round(us / 1e3 / steps, 3), round(n / steps, 2)]
                                   for (before, after), (us, n) in worst]}


def _profiled(fn, device: torch.device):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t
    return prof, wall


def _sampler_with_rows(model, rows: int, prompt: int, new: int, slots: list, graphs: bool) -> Sampler:
    """A sampler holding ``rows`` queued requests of random ``prompt``-token prompts and ``new``
    tokens each, row ``i`` on ``slots[i % len(slots)]``."""
    sampler = Sampler(model, lambda toks: "", max_rows=rows, cuda_graphs=graphs)
    rng = np.random.default_rng(0)
    for i in range(rows):
        params = SamplingParams(max_tokens=new, temperature=1.0, stop=[], seed=i)
        sampler.add(SampleTask(i, slots[i % len(slots)], SampleInput(rng.integers(4, 2000, prompt), 1, params)))
    return sampler


def decode_step(model_dir, device, quick: bool) -> dict:
    """The kernels of eager decode steps of 64 rows (128-token prompts), base model, then with
    8 adapters in turn."""
    rows, prompt, new = (4, 16, 64) if quick else (64, 128, 256)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=8, max_lora_rank=RANK, max_training_runs=8)
    units = [rt.create_adapter(LoraSpec(rank=RANK, seed=i)) for i in range(8)]
    out: dict = {"rows": rows, "prompt_tokens": prompt}
    for name, slots in (("base", [None]), ("adapters_8", units)):
        sampler = _sampler_with_rows(lm.model, rows, prompt, new, slots, graphs=False)
        with torch.inference_mode():
            for _ in range(rows):  # every row admitted and prefilled (in several waves past the
                sampler.step(budget_s=0.0)  # prefill's token budget), so that only decode steps are profiled
                if not sampler.inbox:
                    break
            sampler.step(budget_s=0.05)  # warm
            before = sampler.stats["decode_steps"]
            prof, wall = _profiled(lambda: sampler.step(budget_s=0.02 if quick else 0.3), device)
            steps = sampler.stats["decode_steps"] - before
            sampler.abort()
        out[name] = kernel_table(prof, steps, wall)
    return out


def _host_top(fn, steps_of, n: int = 8) -> list[list]:
    """Run ``fn`` under cProfile: its ``n`` costliest functions by own time, ms per step (a decode
    step, or a training step; ``steps_of()`` counts the steps ``fn`` ran), the waits included (a
    read-back as the time of the tensor's ``tolist``, a synchronisation as its call's)."""
    before = steps_of()
    prof = cProfile.Profile()
    prof.runcall(fn)
    steps = max(1, steps_of() - before)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [[f"{name} ({file.rsplit('/', 1)[-1]}:{line})"[:90], round(1e3 * own / steps, 3), calls]
            for (file, line, name), (calls, _, own, _, _) in rows]


def decode_replayed(model_dir, device, quick: bool) -> dict:
    """Where the wall time of decode steps replayed from CUDA graphs goes (the server's path): the
    kernels' device ms per step against the wall ms per step (the difference is the device waiting
    for the host), and the host's costliest functions per step. 64 and 256 rows of the base model,
    and 64 rows with 8 adapters in turn; 128-token prompts, each case warmed up (its captures) first."""
    cases = ((4, None), (4, 8)) if quick else ((64, None), (256, None), (64, 8))
    # Enough new tokens that no row ends within the timed budgets, which count time, not steps (a
    # quick run's 64 could run out on a fast CPU, and the bursts after would write past the rows' end).
    prompt, new = (16, 1024) if quick else (128, 1024)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=8, max_lora_rank=RANK, max_training_runs=8)
    units = [rt.create_adapter(LoraSpec(rank=RANK, seed=i)) for i in range(8)]
    out: dict = {"prompt_tokens": prompt}
    for rows, adapters in cases:
        slots = units[:adapters] if adapters else [None]
        sampler = _sampler_with_rows(lm.model, rows, prompt, new, slots, graphs=device.type == "cuda")
        with torch.inference_mode():
            for _ in range(rows):  # every row admitted and prefilled (in several waves past the
                sampler.step(budget_s=0.0)  # prefill's token budget), so that only decode steps are profiled
                if not sampler.inbox:
                    break
            sampler.step(budget_s=0.2)  # warm: the bucket's captures
            before = sampler.stats["decode_steps"]
            prof, wall = _profiled(lambda: sampler.step(budget_s=0.02 if quick else 0.25), device)
            table = kernel_table(prof, sampler.stats["decode_steps"] - before, wall)
            table["host_top"] = _host_top(lambda: sampler.step(budget_s=0.02 if quick else 0.25),
                                          lambda: sampler.stats["decode_steps"])
            table.update(_unprofiled_split(sampler, device, 4 if quick else 16, 0.02 if quick else 0.25))
            sampler.abort()
        out[f"rows_{rows}" + (f"_adapters_{adapters}" if adapters else "")] = table
    return out


def _unprofiled_split(sampler: Sampler, device: torch.device, k: int, budget_s: float) -> dict:
    """Wall ms per decode step without the profiler, three ways, to tell where a replayed step's
    idle device time comes from: the sampler's own steps (bursts, reads, the host's work between
    bursts), ``k`` static steps back to back through ``DecodeGraphs.burst`` (each a replay and two
    small copies of its outputs, no read until the end), and the step's graph replayed ``k`` times
    alone (nothing else launched). Equal figures put the idle time inside the graph's execution;
    a lower one for the bare replays puts it in what the sampler launches or waits for around them.

    Replays outside the sampler advance the rows' cache lengths on the device behind its back:
    room for them is reserved first, and the sampler is only fit to be aborted afterwards."""
    before, t = sampler.stats["decode_steps"], time.perf_counter()
    sampler.step(budget_s=budget_s)
    sync(device)
    steps = sampler.stats["decode_steps"] - before
    out: dict = {"unprofiled_ms_per_step": 1e3 * (time.perf_counter() - t) / max(steps, 1)}
    graphs = sampler.graphs
    if graphs is None:  # a CPU run: the same static step, run eagerly (it captures nothing)
        graphs = sampler.graphs = DecodeGraphs(sampler.model, sampler.cache, capture=False, stats=sampler.stats)
    rows, n = list(sampler.rows), len(sampler.rows)
    if not rows:
        return out
    # Room for a warm burst and a timed one, then the graphs' replays alone: 3 k positions.
    sampler.cache.reserve([len(r.state.task.input.prompt) + len(r.tokens) + 3 * k for r in rows])
    batch, slots = sampler._batch(), [r.state.task.slot for r in rows]
    graphs.burst(batch, slots, n, k)  # warm: a reallocated cache's graphs are captured again here
    sync(device)
    t = time.perf_counter()
    graphs.burst(batch, slots, n, k)
    sync(device)
    out["burst_alone_ms_per_step"] = 1e3 * (time.perf_counter() - t) / k
    bucket = bucket_for(n)
    graph = next((g for (v, _), g in graphs._graphs.items() if v.rows == bucket), None)
    if graph is not None:
        t = time.perf_counter()
        for _ in range(k):
            graph.replay()
        sync(device)
        out["replays_alone_ms_per_step"] = 1e3 * (time.perf_counter() - t) / k
    return out


def train_step(model_dir, device, quick: bool) -> dict:
    """The kernels of one LoRA r32 forward_backward + optim_step: one tenant with 8 x 1024 tokens,
    then four tenants with 2 x 1024 each (the same tokens); and the host's costliest functions in
    an unprofiled-by-torch step (cProfile, own ms a step: a torch operator's own time is its
    launch, or its wait where it waits), which say what several tenants' idle device waits for."""
    L, rows = (32, 4) if quick else (1024, 8)
    lm = load_model(str(model_dir), device=device)
    vocab = lm.config.vocab_size
    rt = TrainingRuntime(lm.model, max_lora_adapters=4, max_lora_rank=RANK)
    units = [rt.create_adapter(LoraSpec(rank=RANK, seed=i)) for i in range(4)]
    out: dict = {"tokens": rows * L}
    for name, work in (("one_tenant", {units[0]: batch(vocab, rows, L)}),
                       ("four_tenants", {u: batch(vocab, rows // 4, L, seed=i) for i, u in enumerate(units)})):
        one = training_step(rt, work)
        one()  # warm-up
        prof, wall = _profiled(one, device)
        out[name] = kernel_table(prof, 1, wall)
        steps = [0]

        def counted(step=one) -> None:
            step()
            sync(device)
            steps[0] += 1
        out[name]["host_top"] = _host_top(counted, lambda: steps[0], n=12)
    return out
