"""Sampling: decode tokens/s beside the HBM decode bound, many adapters vs base, the transformers
``generate`` baseline, GRPO-style traffic through the SDK (separate requests vs num_samples), and
the decode stall while a long prompt is prefilled whole vs in chunks.

HBM bound of a decode step = bytes it must read (every weight once, plus each row's KV cache at
the mean context length) / measured copy bandwidth (peak.py): rows / that time = bound tokens/s.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.cpu_times import cpu_seconds, own_cpu_seconds
from bench.gpu.peak import sync
from bench.gpu.shapes import param_counts
from tinsmith.kernels import lora_segments, pdl
from tinsmith.models import lora_bank
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime
from tinsmith.worker.service import RuntimeOptions, sampler_kwargs_of


def sizes(quick: bool) -> dict:
    return {"rows": (4, 8), "prompt": 16, "new": 8} if quick else {"rows": (64, 256), "prompt": 128, "new": 256}


def hbm_bound_tokens_per_s(model_dir, rows: int, prompt: int, new: int, copy_bps: float, dtype_bytes: int) -> float:
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    return rows / (step_bytes(config, rows, prompt, new, dtype_bytes) / copy_bps)


def step_bytes(config, rows: int, prompt: int, new: int, dtype_bytes: int) -> float:
    """The bytes a decode step of the base model reads: every weight once (the unembedding whole)
    and each row's K/V at the run's mean context length."""
    n = param_counts(config)
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    return (n["layers"] + n["unembed"]) * dtype_bytes + rows * (prompt + new / 2) * kv_per_token


def roofline_step_s(config, rows: int, prompt: int, new: int, dtype_bytes: int, copy_bps: float,
                    matmul_flops_per_s: float) -> float:
    """A decode step's least time when each of its parts runs at its own bound: the products with
    the weights (every layer's and the unembedding) at the slower of reading the weights once and
    their 2N FLOPs a row at the measured matmul peak, and attention at reading each row's K/V at
    the run's mean context (2 FLOPs a byte at Qwen3's grouped heads: bytes bound at any row count).
    The HBM bound (:func:`step_bytes`) counts bytes alone; the products turn bound by FLOPs where
    the rows' arithmetic outgrows the weights' bytes (about 180 rows on an H200's measured peaks,
    so a 256-row step of the 1.7B shape takes 1.15 ms for them where their bytes take 0.83)."""
    n = param_counts(config)
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    products = max(n["matmul"] * dtype_bytes / copy_bps, 2 * n["matmul"] * rows / matmul_flops_per_s)
    return products + rows * (prompt + new / 2) * kv_per_token / copy_bps


def adapter_bytes_bound_vs_base(config, rows: int, prompt: int, new: int, adapters: int, rank: int,
                                dtype_bytes: int) -> float:
    """The most a decode step of ``rows`` rows taking ``adapters`` rank-``rank`` adapters in turn
    (every linear layer and the unembedding adapted) can keep of the base model's speed when both
    are bound by the bytes a step reads: the base model's weights and K/V, and, with adapters, each
    adapter a row takes read whole once (docs/performance.md, "What the adapter targets ask").
    ``config``: the model's transformers config."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    adapter = (L * per_layer + rank * (h + config.vocab_size)) * dtype_bytes
    base = step_bytes(config, rows, prompt, new, dtype_bytes)
    return base / (base + min(adapters, rows) * adapter)


def bound_with_prefill_tokens_per_s(model_dir, rows: int, prompt: int, new: int, matmul_flops_per_s: float,
                                    hbm_bound: float) -> float:
    """Tokens/s if the run's prefill ran at the measured matmul peak (2N FLOPs a prompt token, the
    unembedding left out: only each prompt's last token needs it) and every decode step at the HBM
    bound (``hbm_bound``, :func:`hbm_bound_tokens_per_s`'s tokens/s): what the run's own figure,
    which includes its prefill, can be held to. At 256 rows of 128-token prompts on the 1.7B shape
    (H200 peaks) that prefill is about 15% of the bound."""
    import transformers

    n = param_counts(transformers.AutoConfig.from_pretrained(str(model_dir)))
    prefill_s = 2 * n["layers"] * rows * prompt / matmul_flops_per_s
    return rows * new / (prefill_s + rows * new / hbm_bound)


def server_sampler(model, device, rows: int, **kw) -> Sampler:
    """A sampler as the server makes one (its default options; on a GPU, graphs on and the K/V
    cache kept when idle, so a second run replays the first's graphs), for up to ``rows`` rows."""
    options = {**sampler_kwargs_of(RuntimeOptions()), "max_rows": rows, "cuda_graphs": device.type == "cuda", **kw}
    return Sampler(model, lambda toks: "", keep_cache_when_idle=device.type == "cuda", **options)


def run_sampler(sampler: Sampler, rows: int, prompt: int, new: int | list[int], slots: list[int | None], seed: int,
                budget_s: float = 1.0) -> float:
    """Wall seconds to sample ``rows`` sequences of exactly ``new`` tokens (prefill included;
    a list: row ``i``'s count). Draws are seeded, so ranks of a sharded sampler (run with an
    infinite ``budget_s``) agree."""
    rng = np.random.default_rng(seed)
    for i in range(rows):
        params = SamplingParams(max_tokens=new[i] if isinstance(new, list) else new, temperature=1.0, stop=[],
                                seed=seed * 1_000_003 + i)
        sampler.add(SampleTask(i, slots[i % len(slots)],
                               SampleInput(prompt=rng.integers(4, 2000, prompt), num_samples=1, params=params)))
    sync(sampler.device)
    t = time.perf_counter()
    finished = 0
    with torch.inference_mode():
        while finished < rows:
            for _, res in sampler.step(budget_s=budget_s):
                if isinstance(res, Exception):
                    raise res
                finished += 1
    sync(sampler.device)
    return time.perf_counter() - t


def in_process(model_dir, device, peak: dict, quick: bool, adapters: bool = True) -> dict:
    """Decode tokens/s at each row count, and (``adapters``) with 8 and 64 adapters against the base
    model at each row count, beside what the bytes a step reads allow
    (:func:`adapter_bytes_bound_vs_base`).

    Each figure is the second of two equal runs: the first pays the CUDA graph captures of its
    bucket, spans and adapter mix (what an RL loop pays once, then replays), and is reported
    beside it as ``first_run_tokens_per_s``. The sampler keeps its K/V cache between runs as the
    server's does on a GPU (it used to give it back, so each run's cache grew again and could
    capture its graphs again); ``captures_in_timed_run`` counts the second run's captures.
    """
    import transformers

    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    dtype_bytes = next(lm.model.parameters()).element_size()
    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    # As the server runs it: decode steps replayed from CUDA graphs on a GPU (graphs_vs_eager
    # compares), the K/V cache and its graphs kept between runs, the server's default options.
    sampler = server_sampler(lm.model, device, max(z["rows"]))
    out: dict = {"prompt_tokens": z["prompt"], "new_tokens": z["new"]}

    captures = {"second_run": 0}
    counted = ("graph_captures", "graph_replays", "decode_steps", "decode_reads", "prefills", "prefill_tokens",
               "preempted", "recomputed_tokens", "admitting_s")
    timed_stats: dict = {}

    def twice(rows: int, slots: list) -> tuple[float, float]:
        """(first, second) run's seconds for ``rows`` rows of ``slots`` in turn; the second run's
        graph captures in ``captures``, its sampler counters (steps, prefills, preemptions) in
        ``timed_stats``."""
        first = run_sampler(sampler, rows, z["prompt"], z["new"], slots, seed=rows)
        before = {k: sampler.stats.get(k, 0) for k in counted}
        second = run_sampler(sampler, rows, z["prompt"], z["new"], slots, seed=rows + 1)
        captures["second_run"] = sampler.stats.get("graph_captures", 0) - before["graph_captures"]
        timed_stats.update({k: sampler.stats.get(k, 0) - before[k] for k in counted})
        return first, second

    for rows in z["rows"]:
        first, s = twice(rows, [None])
        tps = rows * z["new"] / s
        bound = hbm_bound_tokens_per_s(model_dir, rows, z["prompt"], z["new"], peak["copy_bytes_per_s"], dtype_bytes)
        with_prefill = bound_with_prefill_tokens_per_s(model_dir, rows, z["prompt"], z["new"], peak["matmul_flops_per_s"],
                                                       bound)
        roofline = rows / roofline_step_s(config, rows, z["prompt"], z["new"], dtype_bytes, peak["copy_bytes_per_s"],
                                          peak["matmul_flops_per_s"])
        roofline_with_prefill = bound_with_prefill_tokens_per_s(model_dir, rows, z["prompt"], z["new"],
                                                                peak["matmul_flops_per_s"], roofline)
        out[f"rows_{rows}"] = {"tokens_per_s": tps, "hbm_bound_tokens_per_s": bound, "of_hbm_bound": tps / bound,
                               "bound_with_prefill_tokens_per_s": with_prefill, "of_bound_with_prefill": tps / with_prefill,
                               # bytes and FLOPs: the products of a step of many rows are bound by FLOPs
                               "roofline_tokens_per_s": roofline, "roofline_with_prefill_tokens_per_s": roofline_with_prefill,
                               "of_roofline_with_prefill": tps / roofline_with_prefill,
                               "first_run_tokens_per_s": rows * z["new"] / first,
                               "captures_in_timed_run": captures["second_run"], "timed_run_stats": dict(timed_stats)}
    # Rows take the adapters in turn (64 rows, 64 adapters: one row each), every projection adapted.
    # The adapter targets are read at the first row count; the second's (its K/V weighs
    # more beside the adapters, so the bytes allow a higher share) is measured too, without tiles.
    if adapters:
        rt = TrainingRuntime(lm.model, max_lora_adapters=64, max_lora_rank=32, max_training_runs=64)
        units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(64)]
        for rows in z["rows"]:
            base_s = twice(rows, [None])[1]
            for n in (8, 64):
                first, multi_s = twice(rows, units[:n])
                bytes_bound = adapter_bytes_bound_vs_base(config, rows, z["prompt"], z["new"], n, 32, dtype_bytes)
                out[key := adapters_key(n, rows, z)] = {
                    "rows": rows, "base_tokens_per_s": rows * z["new"] / base_s,
                    "adapters_tokens_per_s": rows * z["new"] / multi_s, "vs_base": base_s / multi_s,
                    "bytes_bound_vs_base": bytes_bound, "of_bytes_bound": base_s / multi_s / bytes_bound,
                    "first_run_tokens_per_s": rows * z["new"] / first,
                    "timed_run_stats": dict(timed_stats)}  # admitting_s: its prefill's share
                if rows == z["rows"][0] and lora_segments.triton is not None and device.type == "cuda":
                    enabled = lora_segments.ENABLED  # the same rows by tiles (SGMV), same run
                    lora_segments.ENABLED = True
                    try:
                        tiled_s = twice(rows, units[:n])[1]
                    finally:
                        lora_segments.ENABLED = enabled
                    out[key].update({"segmented_tokens_per_s": rows * z["new"] / tiled_s,
                                     "segmented_vs_base": base_s / tiled_s, "segmented_vs_gathered": multi_s / tiled_s,
                                     "segmented_kernels_failed": lora_segments.GUARD.failed})
    if sampler.graphs is not None:
        out["graphs"] = {"captures": sampler.stats["graph_captures"], "replays": sampler.stats["graph_replays"],
                         "broken": sampler.graphs.broken}
    return out


def adapters_key(n: int, rows: int, z: dict) -> str:
    """The decode item's key for ``n`` adapters at ``rows`` rows: ``adapters_N`` at the first row
    count (the issue's targets read it), ``adapters_N_rows_R`` at the others."""
    return f"adapters_{n}" if rows == z["rows"][0] else f"adapters_{n}_rows_{rows}"


def _decode_rate(lm, device, z: dict, rows: int, slots: list) -> float:
    """Decode tokens/s of ``rows`` rows of ``slots`` on a sampler of its own (its graphs captured in
    the process's present modes): the second of two equal runs."""
    sampler = server_sampler(lm.model, device, rows)
    run_sampler(sampler, rows, z["prompt"], z["new"], slots, seed=1)  # its captures
    rate = rows * z["new"] / run_sampler(sampler, rows, z["prompt"], z["new"], slots, seed=2)
    del sampler
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def _switch_compared(lm, device, z: dict, rows: int, cases: list[tuple[str, list]], switch, on, off) -> dict:
    """Decode tokens/s of ``rows`` rows of each case's ``slots`` with ``switch(on)`` and
    ``switch(off)``, in one process (:func:`_decode_rate`), in the order on, off, on (so drift
    shows); ``on_vs_off`` divides the two on runs' mean by the off run."""
    out: dict = {}
    for label, slots in cases:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for mode in ("on", "off", "on"):
            switch(on if mode == "on" else off)
            rates[mode].append(_decode_rate(lm, device, z, rows, slots))
        mean_on = sum(rates["on"]) / len(rates["on"])
        out[label] = {"on_tokens_per_s": rates["on"], "off_tokens_per_s": rates["off"][0],
                      "on_vs_off": mean_on / rates["off"][0]}
    return out


def dependent_launches(model_dir, device, quick: bool) -> dict:
    """Decode tokens/s with the Triton kernels launched dependent on the kernel before
    (:mod:`tinsmith.kernels.pdl`) and launched as before, in one process: the first row count's rows
    of the base model and over 8 adapters (:func:`_switch_compared`)."""
    z = sizes(quick)
    rows = z["rows"][0]
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=8, max_lora_rank=32)
    units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(8)]
    probe = torch.empty(1, device=device)
    out: dict = {"rows": rows, "active": pdl.active(probe),
                 "off_reason": pdl.off_reason(device) if device.type == "cuda" else "not a CUDA device"}
    before = pdl.ENABLED  # as the run had it (the server's option), put back after

    def switch(mode: str) -> None:
        pdl.ENABLED = mode

    try:
        out.update(_switch_compared(lm, device, z, rows, [("base", [None]), ("adapters_8", units)], switch, "auto",
                                    "off"))
    finally:
        pdl.ENABLED = before
    return out


def expands_in_kernels(model_dir, device, quick: bool) -> dict:
    """Decode tokens/s of the first row count's rows over 8 and 64 adapters with the adapter banks'
    expands left to the kernels that read their projections' outputs (the kernel turning the q/k
    heads and storing the keys and values, the SiLU product, the residual adds and norms:
    :data:`tinsmith.models.lora_bank.EXPANDS_TAKEN`) and the down projection's shrink to the SiLU
    product (:data:`tinsmith.models.lora_bank.SHRINKS_TAKEN`), and with every expand and shrink its
    own launch, in one process (:func:`_switch_compared`); then with all but the norms' expands
    taken (their per-row programs read a whole block of B each: ``without_norms_vs_off``) and with
    all but the SiLU product's shrink (``without_silu_shrink_vs_off``). On a CPU every mode runs the
    same torch ops."""
    z = sizes(quick)
    rows = z["rows"][0]
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=64, max_lora_rank=32, max_training_runs=64)
    units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(64)]
    before = lora_bank.EXPANDS_TAKEN, lora_bank.SHRINKS_TAKEN
    every, silu = frozenset({"heads", "silu", "norms"}), frozenset({"silu"})

    def switch(taken: tuple[frozenset[str], frozenset[str]]) -> None:
        lora_bank.EXPANDS_TAKEN, lora_bank.SHRINKS_TAKEN = taken

    cases = [("adapters_8", units[:8]), ("adapters_64", units)]
    try:
        out = _switch_compared(lm, device, z, rows, cases, switch, (every, silu), (frozenset(), frozenset()))
        for mode, taken in (("without_norms", (every - {"norms"}, silu)), ("without_silu_shrink", (every, frozenset()))):
            switch(taken)
            for label, slots in cases:
                rate = _decode_rate(lm, device, z, rows, slots)
                out[label].update({f"{mode}_tokens_per_s": rate, f"{mode}_vs_off": rate / out[label]["off_tokens_per_s"]})
    finally:
        switch(before)
    return {"rows": rows, **out}


def decode_bursts(model_dir, device, quick: bool) -> dict:
    """Decode tokens/s (graphs on, base model) with 4, 8 and 16 steps per host read-back
    (``Sampler(decode_burst=...)``), each queued ahead of the last burst's read (the default),
    and 4 steps read before the next is queued (``run_ahead=False``): how much of a step the host's
    work between bursts costs, and how much of it running ahead takes off the device's timeline.
    Each figure is the second of two equal runs (the first pays its captures); the default
    (4, ahead) runs again, so drift shows as ``burst_4_again``. ``scattered_ends_*``: the same
    with rows ending at scattered steps (half the new tokens to all of them), as RL's rows end,
    ahead and read first."""
    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    out: dict = {"prompt_tokens": z["prompt"], "new_tokens": z["new"]}
    for rows in z["rows"]:
        row: dict = {}
        for name, burst, ahead in (("burst_4", 4, True), ("burst_4_read_first", 4, False), ("burst_8", 8, True),
                                   ("burst_16", 16, True), ("burst_4_again", 4, True)):
            sampler = server_sampler(lm.model, device, rows, decode_burst=burst, run_ahead=ahead)
            run_sampler(sampler, rows, z["prompt"], z["new"], [None], seed=rows)
            s = run_sampler(sampler, rows, z["prompt"], z["new"], [None], seed=rows + 1)
            row[name] = rows * z["new"] / s
            if ahead:
                row[f"{name}_bursts_ahead"] = sampler.stats["bursts_ahead"]
            del sampler
        row["burst_16_vs_4"] = row["burst_16"] / row["burst_4"]
        row["ahead_vs_read_first"] = (row["burst_4"] + row["burst_4_again"]) / 2 / row["burst_4_read_first"]
        # Rows ending at scattered steps, as RL's do: from half the new tokens to all of them.
        lengths = [z["new"] // 2 + (i * z["new"] // 2) // rows for i in range(rows)]
        for name, ahead in (("scattered_ends_ahead", True), ("scattered_ends_read_first", False)):
            sampler = server_sampler(lm.model, device, rows, decode_burst=4, run_ahead=ahead)
            run_sampler(sampler, rows, z["prompt"], lengths, [None], seed=rows)
            s = run_sampler(sampler, rows, z["prompt"], lengths, [None], seed=rows + 1)
            row[name] = sum(lengths) / s
            if ahead:
                row["scattered_ends_rows_left_ahead"] = sampler.stats["rows_left_ahead"]
            del sampler
        row["scattered_ahead_vs_read_first"] = row["scattered_ends_ahead"] / row["scattered_ends_read_first"]
        out[f"rows_{rows}"] = row
    return out


def graphs_vs_eager(model_dir, device, quick: bool) -> dict:
    """Decode tokens/s with the decode step replayed from CUDA graphs vs launched eagerly, same
    rows (base model, then 8 adapters in turn); each side warmed up by a short run at its row
    count first (the bucket's first capture), so the timed run pays only the recaptures of its
    cache growth (counted)."""
    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=8, max_lora_rank=32, max_training_runs=8)
    units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(8)]
    out: dict = {"prompt_tokens": z["prompt"], "new_tokens": z["new"]}
    for rows in z["rows"]:
        for name, slots in (("base", [None]), ("adapters_8", units)):
            row: dict = {}
            for graphs in (False, True):
                sampler = Sampler(lm.model, lambda toks: "", max_rows=rows, cuda_graphs=graphs)
                run_sampler(sampler, rows, z["prompt"], 4, slots, seed=98)  # warm-up (and first captures)
                before = dict(sampler.stats)
                s = run_sampler(sampler, rows, z["prompt"], z["new"], slots, seed=rows)
                key = "graphs" if graphs else "eager"
                row[f"{key}_tokens_per_s"] = rows * z["new"] / s
                if graphs:  # counters absent where graphs are off (on a CPU): 0
                    for stat in ("graph_replays", "graph_captures", "decode_steps"):
                        row[stat] = sampler.stats.get(stat, 0) - before.get(stat, 0)
                del sampler
            row["graphs_vs_eager"] = row["graphs_tokens_per_s"] / row["eager_tokens_per_s"]
            out[f"rows_{rows}_{name}"] = row
    del rt, lm
    return out


def chunked_prefill(model_dir, device, quick: bool) -> dict:
    """Decode rows' longest stall while a long prompt is prefilled, whole vs in chunks of the CUDA
    default (see bench/prefill_micro.py); ``same_tokens`` may be False in bf16 (different kernels)."""
    from bench.prefill_micro import compare
    from tinsmith.sampling.sampler import DEFAULT_PREFILL_CHUNK_TOKENS

    lm = load_model(str(model_dir), device=device)
    if quick:
        return compare(lm.model, rows=4, prompt_length=512, new_tokens=16, chunks=[0, 128], repeats=1)
    return compare(lm.model, rows=64, prompt_length=16384, new_tokens=64,
                   chunks=[0, DEFAULT_PREFILL_CHUNK_TOKENS["cuda"]], repeats=1)


def generate_baseline(model_dir, device, quick: bool) -> dict:
    import transformers

    z = sizes(quick)
    rows = z["rows"][0]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.randint(4, 2000, (rows, z["prompt"]), device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=z["new"], min_new_tokens=z["new"], pad_token_id=3)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(device)
        t = time.perf_counter()
        model.generate(ids, **kw)
        sync(device)
    s = time.perf_counter() - t
    return {"rows": rows, "tokens_per_s": rows * z["new"] / s, "transformers": transformers.__version__}


def sdk_prompts(seed: int, n: int, new: int, quick: bool) -> tuple[list, object]:
    """``n`` random prompts of 128 tokens (16 when quick) as the SDK sends them, and sampling
    parameters for exactly ``new`` tokens at temperature 1."""
    from tinker import types

    rng = np.random.default_rng(seed)
    prompts = [types.ModelInput.from_ints(rng.integers(4, 2000, 16 if quick else 128).tolist()) for _ in range(n)]
    return prompts, types.SamplingParams(max_tokens=new, temperature=1.0, stop=[])


def through_sdk(model_dir, device, quick: bool, log_dir: Path, transport: str = "httpx") -> dict:
    """A real server: first-call latency, then GRPO traffic as separate requests vs num_samples;
    ``transport``: the HTTP transport the server hands the SDK (``--client-http-transport``)."""
    import tinker

    from tests.e2e.server import ServerProcess

    prompts_n, group, new = (2, 4, 8) if quick else (8, 16, 256)
    srv = ServerProcess(model_dir, log_dir / "server-data", log_dir=log_dir,
                        extra_args=["--device", device.type, "--client-http-transport", transport])
    database = log_dir / "server-data" / "tinsmith.sqlite"
    srv.start(timeout=600)
    try:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench-gpu")
        s = sc.create_sampling_client(base_model=str(model_dir)).result(timeout=600)
        prompts, params = sdk_prompts(0, prompts_n, new, quick)
        first = []
        for _ in range(2):
            t = time.perf_counter()
            s.sample(prompts[0], 1, params).result(timeout=600)
            first.append(time.perf_counter() - t)

        spans: list[tuple[float, float]] = []  # each round's (start, end), epoch seconds
        cpu: list[dict] = []  # each round's CPU per request: this client's (the SDK), the server's, its loop's
        pid = srv.proc.pid

        sends: list[list[float]] = []  # each round's asample sends by the SDK, epoch seconds

        def timed_tokens(submit) -> tuple[float, int]:
            """Submit every request at once (the SDK's futures), then wait for all."""
            before = (own_cpu_seconds(), cpu_seconds(pid), cpu_seconds(pid, pid))
            t, start = time.perf_counter(), time.time()
            with asample_sends() as sent:
                futures = submit()
                results = [f.result(timeout=600) for f in futures]
            spans.append((start, time.time()))
            sends.append(sent)
            after = (own_cpu_seconds(), cpu_seconds(pid), cpu_seconds(pid, pid))
            cpu.append({f"{who}_ms_per_request": 1e3 * (b - a) / len(futures)
                        for who, a, b in zip(("client", "server", "server_loop"), before, after)})
            return time.perf_counter() - t, sum(len(q.tokens) for r in results for q in r.sequences)

        # Each round samples prompts of its own, as an RL loop's rounds do (new problems, and new
        # weights after each step): nothing of an earlier round's prompts is in the prefix cache.
        rounds = iter(range(1, 5))

        def separate():
            prompts = sdk_prompts(next(rounds), prompts_n, new, quick)[0]
            return [s.sample(p, 1, params) for p in prompts for _ in range(group)]

        def num_samples():
            prompts = sdk_prompts(next(rounds), prompts_n, new, quick)[0]
            return [s.sample(p, group, params) for p in prompts]

        # A first round of each pays what a training loop pays once (the decode graphs of each
        # batch size the requests pass through as they arrive); the figures are the second's.
        first_sep_s, _ = timed_tokens(separate)
        first_ns_s, _ = timed_tokens(num_samples)
        before = server_counters(srv.base_url)
        sep_s, sep_tok = timed_tokens(separate)
        between = server_counters(srv.base_url)
        ns_s, ns_tok = timed_tokens(num_samples)
        after = server_counters(srv.base_url)
        separate_timeline = request_timeline(database, *spans[2], sends[2])
        # What the ratio would be had every request arrived at once (the round less its arrival
        # window: from its start to the last request stored): the window's share of the shortfall.
        after_last = sep_s - separate_timeline.get("last_arrival_s", 0.0)
        return {"first_call_s": first[0], "second_call_s": first[1], "new_tokens": new,
                "grpo": {"prompts": prompts_n, "group": group,
                         "separate_requests_tokens_per_s": sep_tok / sep_s,
                         "num_samples_tokens_per_s": ns_tok / ns_s, "separate_vs_num_samples": ns_s / sep_s,
                         "first_round_separate_vs_num_samples": first_ns_s / first_sep_s,
                         # where the time went, as the server counts it (means per request, seconds)
                         "separate_server": counter_means(before, between),
                         "num_samples_server": counter_means(between, after),
                         # whose CPU a request costs: is the arrival window the SDK's or the server's?
                         "separate_cpu": cpu[2], "num_samples_cpu": cpu[3],
                         "separate_timeline": separate_timeline,
                         "separate_after_last_arrival_vs_num_samples": ns_s / after_last if after_last > 0 else None,
                         "num_samples_timeline": request_timeline(database, *spans[3], sends[3])}}
    finally:
        srv.stop()


def beside_training(model_dir, device, quick: bool, log_dir: Path) -> dict:
    """A real server, two tenants: one trains (LoRA r32, forward_backward + optim_step) while the
    other samples (8 prompts x 8 samples). Each alone, then both at once: tokens/s of each, and
    what each keeps of its speed alone (both must go on; neither may starve the other).

    The training alone is also a training loop through the SDK as a user runs it (each step's
    results awaited before the next is sent), beside the in-process step that issue 14's figures
    read: ``train_alone_steps`` splits its steps' wall time into the server's own account of them
    (:func:`training_step_parts`) and the rest (the SDK, HTTP, the hand-offs);
    ``train_ahead_tokens_per_s`` is the same loop with each step sent before the last one's
    results are awaited."""
    import threading

    import tinker
    from tinker import types

    from tests.e2e.helpers import sft_batch
    from tests.e2e.server import ServerProcess

    rows, length, steps = (2, 32, 2) if quick else (8, 1024, 4)
    prompts_n, group, new = (2, 2, 8) if quick else (8, 8, 256)
    srv = ServerProcess(model_dir, log_dir / "server-data", extra_args=["--device", device.type], log_dir=log_dir)
    srv.start(timeout=600)
    try:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench-trainer")
        tc = sc.create_lora_training_client(base_model=str(model_dir), rank=32).result(timeout=600)
        data = sft_batch(0, rows, length, 2000)
        sampler_sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench-sampler")
        s = sampler_sc.create_sampling_client(base_model=str(model_dir)).result(timeout=600)
        prompts, params = sdk_prompts(1, prompts_n, new, quick)

        def train() -> float:
            t = time.perf_counter()
            for _ in range(steps):
                fb = tc.forward_backward(data, "cross_entropy")
                op = tc.optim_step(types.AdamParams(learning_rate=1e-5))
                fb.result(timeout=600)
                op.result(timeout=600)
            return rows * length * steps / (time.perf_counter() - t)

        def train_ahead() -> float:
            """The same steps with the next one sent before the last one's results are awaited (as
            pipelined training loops do): the round trips between steps hidden behind the work."""
            t = time.perf_counter()
            pending: list = []
            for _ in range(steps):
                pending.append((tc.forward_backward(data, "cross_entropy"),
                                tc.optim_step(types.AdamParams(learning_rate=1e-5))))
                if len(pending) > 1:
                    for f in pending.pop(0):
                        f.result(timeout=600)
            for f in (f for step in pending for f in step):
                f.result(timeout=600)
            return rows * length * steps / (time.perf_counter() - t)

        def sample_all() -> float:
            t = time.perf_counter()
            results = [f.result(timeout=600) for f in [s.sample(p, group, params) for p in prompts]]
            return sum(len(q.tokens) for r in results for q in r.sequences) / (time.perf_counter() - t)

        train(), sample_all()  # warm: first-call costs out of the figures
        before = server_counters(srv.base_url, _TRAIN_COUNTERS), own_cpu_seconds(), cpu_seconds(srv.proc.pid)
        start = time.time()
        alone = {"train_tokens_per_s": train()}
        end = time.time()
        after = server_counters(srv.base_url, _TRAIN_COUNTERS), own_cpu_seconds(), cpu_seconds(srv.proc.pid)
        alone["train_ahead_tokens_per_s"] = train_ahead()
        alone["sample_tokens_per_s"] = sample_all()
        parts = training_step_parts(log_dir / "server-data" / "tinsmith.sqlite", start, end,
                                    rows * length / alone["train_tokens_per_s"], before[0], after[0])
        parts.update(client_cpu_ms_per_step=1e3 * (after[1] - before[1]) / steps,
                     server_cpu_ms_per_step=1e3 * (after[2] - before[2]) / steps,
                     micro_batch_tokens=planned_micro_batch_tokens(log_dir), rows=rows, length=length)
        together: dict[str, float] = {}
        trainer = threading.Thread(target=lambda: together.__setitem__("train_tokens_per_s", train()))
        trainer.start()
        together["sample_tokens_per_s"] = sample_all()
        trainer.join()
        return {"alone": alone, "together": together, "train_alone_steps": parts,
                "train_kept": together["train_tokens_per_s"] / alone["train_tokens_per_s"],
                "sample_kept": together["sample_tokens_per_s"] / alone["sample_tokens_per_s"]}
    finally:
        srv.stop()


# The server's Prometheus series that say where a sample request's time goes: (name, labels).
_COUNTERS = {
    "asample_http": ("tinsmith_http_request_duration_seconds", {"route": "/api/v1/asample"}),
    "queue_wait": ("tinsmith_queue_wait_seconds", {"operation": "sample"}),
    "step": ("tinsmith_step_seconds", {"operation": "sample"}),
}


# ... and the HTTP time of a training step's requests (retrieve_future's long-polls included).
_TRAIN_COUNTERS = {f"{op}_http": ("tinsmith_http_request_duration_seconds", {"route": f"/api/v1/{op}"})
                   for op in ("forward_backward", "optim_step", "retrieve_future")}


def training_step_parts(database: Path, start: float, end: float, step_s: float,
                        before: dict[str, float], after: dict[str, float]) -> dict:
    """Where the training steps between ``start`` and ``end`` (epoch seconds; ``step_s`` of wall
    time each as the client saw it, each a forward_backward then an optim_step) went, in ms a
    step (means): as the server's store recorded them, each forward_backward's wait in the queue
    and its run, the optim_step's wait after it and its run, the server's whole span (the
    forward_backward reaching the store to the optim_step's result stored) and what that leaves
    of the step (``rest_ms``: the SDK, HTTP and the hand-offs, where the step's requests are not
    on the server); and from ``/metrics`` (``before``/``after`` of :data:`_TRAIN_COUNTERS`) the
    requests' HTTP time."""
    from bench.store_times import request_spans

    fbs = [r for r in request_spans(database, "forward_backward") if start <= r[0] <= end]
    opts = [r for r in request_spans(database, "optim_step") if start <= r[0] <= end]
    out: dict = {"step_ms": 1e3 * step_s, "steps": min(len(fbs), len(opts))}
    pairs = [(f, o) for f, o in zip(fbs, opts) if f[1] is not None and o[1] is not None]
    if pairs:
        def mean_ms(values) -> float:
            values = list(values)
            return 1e3 * sum(values) / len(values)

        out.update(forward_backward_queue_ms=mean_ms(f[1] - f[0] for f, _ in pairs),
                   forward_backward_run_ms=mean_ms(f[2] - f[1] for f, _ in pairs),
                   optim_step_wait_ms=mean_ms(o[1] - f[2] for f, o in pairs),
                   optim_step_run_ms=mean_ms(o[2] - o[1] for _, o in pairs),
                   server_span_ms=mean_ms(o[2] - f[0] for f, o in pairs))
        out["rest_ms"] = out["step_ms"] - out["server_span_ms"]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    for key in _TRAIN_COUNTERS:
        if delta.get(f"{key}_count"):
            out[f"{key}_ms"] = 1e3 * delta[f"{key}_sum"] / max(1, out["steps"])
    return out


def planned_micro_batch_tokens(log_dir: Path) -> int | None:
    """The training micro-batch size the server planned, from its start-up line in its log."""
    for log in sorted(log_dir.glob("server-*.log")):
        found = re.search(r"training micro-batches of (\d+) tokens", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
    return None


def server_counters(base_url: str, counters: dict | None = None) -> dict[str, float]:
    """Sums and counts of ``counters`` (default :data:`_COUNTERS`) and the prefill/sampled token
    totals, from ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        for sample in family.samples:
            for key, (name, labels) in (counters or _COUNTERS).items():
                if sample.name in (name + "_sum", name + "_count") and labels.items() <= sample.labels.items():
                    field = f"{key}_{sample.name.rsplit('_', 1)[1]}"
                    out[field] = out.get(field, 0.0) + sample.value
            if sample.name in _TOTALS:  # summed over labels (the collector's counters are by generation)
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


# Counters read whole (their deltas between two reads): what the samplers did meanwhile.
_TOTALS = ("tinsmith_prefill_tokens_total", "tinsmith_sampled_tokens_total", "tinsmith_sampler_prefills_total",
           "tinsmith_decode_graph_captures_total", "tinsmith_decode_steps_total", "tinsmith_gc_collections_total",
           "tinsmith_gc_pause_seconds_total", "tinsmith_sampler_admissions_total",
           "tinsmith_sampler_admission_wait_seconds_total")


def counter_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-request means of each series between two reads (HTTP time of ``asample`` itself, the
    wait in the engine's queue, the sampling step), and the prompt tokens computed, the samplers'
    passes and steps, and the garbage collector's collections and pauses meanwhile."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {f"{key}_mean_s": delta[f"{key}_sum"] / delta[f"{key}_count"]
           for key in _COUNTERS if delta.get(f"{key}_count")}
    out["requests"] = delta.get("asample_http_count", 0.0)
    out["prefill_tokens"] = delta.get("tinsmith_prefill_tokens_total", 0.0)
    out["prefills"] = delta.get("tinsmith_sampler_prefills_total", 0.0)
    out["graph_captures"] = delta.get("tinsmith_decode_graph_captures_total", 0.0)
    out["decode_steps"] = delta.get("tinsmith_decode_steps_total", 0.0)
    out["gc_collections"] = delta.get("tinsmith_gc_collections_total", 0.0)  # the server process's, every generation
    out["gc_pause_s"] = delta.get("tinsmith_gc_pause_seconds_total", 0.0)
    admitted = delta.get("tinsmith_sampler_admissions_total", 0.0)
    if admitted:  # the wait in the sampler's own queue, after the engine's (queue_wait)
        out["admission_wait_mean_s"] = delta.get("tinsmith_sampler_admission_wait_seconds_total", 0.0) / admitted
    return out


def request_timeline(database: Path, start: float, end: float, sent: Sequence[float] = ()) -> dict[str, float]:
    """When the sample requests created between ``start`` and ``end`` (epoch seconds) reached the
    server's store, when each left the queue to join the sampler's batch, and when they completed,
    in seconds after ``start``: whether a round's time went to the requests' arrival, to their wait
    for the sampler, or to decoding after the last one arrived. Reads the server's SQLite file (the
    embedded default store). ``sent``: when the client handed each request to its HTTP client
    (:func:`asample_sends`), so that the arrival window splits into the client's dispatch and the
    server's intake."""
    from bench.store_times import request_spans

    rows = [(c - start, None if s is None else s - start, d - start)
            for c, s, d in request_spans(database, "sample") if start <= c <= end]
    if not rows:
        return {}
    created, completed = [c for c, _, _ in rows], [d for _, _, d in rows]
    out = {"requests": len(rows), "first_arrival_s": min(created), "last_arrival_s": max(created),
           "first_completion_s": min(completed), "last_completion_s": max(completed),
           "decode_after_last_arrival_s": max(completed) - max(created)}
    if sent:
        out.update({"first_send_s": min(sent) - start, "last_send_s": max(sent) - start})
    started = [(c, s) for c, s, _ in rows if s is not None]
    if started:
        out.update({"last_start_s": max(s for _, s in started),
                    "mean_queue_wait_s": sum(s - c for c, s in started) / len(started),
                    "longest_queue_wait_s": max(s - c for c, s in started),
                    "decode_after_last_start_s": max(completed) - max(s for _, s in started)})
    return out


@contextlib.contextmanager
def asample_sends():
    """The epoch seconds at which this process's SDK hands each ``asample`` request to its HTTP
    client (``httpx.AsyncClient.send``, under either transport the server names), in a list
    filled while the block runs."""
    import httpx

    sent: list[float] = []
    original = httpx.AsyncClient.send

    async def send(self, request, *args, **kwargs):
        if request.url.path.endswith("/asample"):
            sent.append(time.time())
        return await original(self, request, *args, **kwargs)

    httpx.AsyncClient.send = send
    try:
        yield sent
    finally:
        httpx.AsyncClient.send = original


def decode_attention(model_dir, device, peak: dict, quick: bool) -> dict:
    """One attention layer's decode step (write the new K/V, attend) over a cache of rows of mixed
    lengths: SDPA over the longest row's span (the eager step), SDPA over the cache's capacity (the
    fixed-shape step CUDA graphs replay), and the decode kernels, which read each row's own
    positions whichever span they are given, over per-row buffers and over pages (the GPU's
    layout; without the kernels, pages are gathered first). ``of_copy_bw``: the K/V bytes the rows
    hold, read once, over the time, as a share of the measured copy bandwidth."""
    from bench.gpu.peak import timed
    from tinsmith.kernels import decode_attention as kernels
    from tinsmith.models.loading import read_config
    from tinsmith.sampling.kv_cache import RowKVCache
    from tinsmith.sampling.paged_kv_cache import PagedKVCache

    cfg = read_config(Path(model_dir))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out: dict = {"heads": hq, "kv_heads": hk, "head_dim": d, "kernels_usable": kernels.usable(torch.empty(0, device=device))}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for rows in ((4,) if quick else (64, 256)):
        lo, hi = (8, 24) if quick else (128, 384)  # a 128-token prompt plus 0..256 sampled tokens
        capacity = 2 * hi  # the static step's cache: grown to twice the span ahead of the rows
        lengths = torch.randint(lo, hi, (rows,), generator=gen)
        caches = {"rows": RowKVCache(cfg, device, dtype, rows=rows), "pages": PagedKVCache(cfg, device, dtype, rows=rows)}
        layer = next(i for i in range(cfg.num_layers) if not cfg.is_linear_layer(i))
        for cache in caches.values():
            cache.ensure(rows, capacity)
            cache.reserve([int(n) + 1 for n in lengths])
            for t in (cache.K[layer], cache.V[layer]):
                t.normal_()
        span = int(lengths.max()) + 1
        q = torch.randn(rows, hq, 1, d, generator=gen).to(device, dtype)
        k, v = (torch.randn(rows, hk, 1, d, generator=gen).to(device, dtype) for _ in range(2))
        live = torch.ones(rows, dtype=torch.long, device=device)
        kv_bytes = 2 * int(lengths.sum() + rows) * hk * d * torch.finfo(dtype).bits // 8

        def step(cache, kernel: bool, width: int, fixed: bool):
            kernels.BACKEND = "auto" if kernel else "torch"
            cache.lengths[:rows] = lengths.to(device)  # the write lands at each row's length, every run
            attend = cache.decode_attention(rows, width, live=live if fixed else None)
            return lambda: attend(layer, q, k, v)

        row: dict = {"span": span, "capacity": capacity, "kv_mbytes": kv_bytes / 1e6}
        try:
            variants = [("sdpa_span", "rows", False, span, False), ("sdpa_capacity", "rows", False, capacity, True),
                        ("pages_gathered_capacity", "pages", False, capacity, True)]
            if out["kernels_usable"]:
                variants += [("kernels_span", "rows", True, span, False), ("kernels_capacity", "rows", True, capacity, True),
                             ("kernels_pages_capacity", "pages", True, capacity, True)]
            for name, layout, kernel, width, fixed in variants:
                s = timed(step(caches[layout], kernel, width, fixed), device, repeats=3 if quick else 50)
                row[name] = {"us": s * 1e6, "of_copy_bw": kv_bytes / s / peak["copy_bytes_per_s"]}
        finally:
            kernels.BACKEND = "auto"
        if "kernels_capacity" in row:
            row["kernels_vs_sdpa_capacity"] = row["sdpa_capacity"]["us"] / row["kernels_capacity"]["us"]
            row["kernels_vs_sdpa_span"] = row["sdpa_span"]["us"] / row["kernels_span"]["us"]
            row["pages_vs_rows_kernels"] = row["kernels_capacity"]["us"] / row["kernels_pages_capacity"]["us"]
        out[f"rows_{rows}"] = row
    return out


def delta_rule_step(device, peak: dict, quick: bool) -> dict:
    """One Gated DeltaNet layer's decode step at Qwen3.5's shape (16 key heads, 32 value heads of
    128 x 128, fp32 states): the torch step (plus the copy of the new states into the sampler's
    rows) against the fused kernel, which advances them in place. ``of_copy_bw``: the states read
    and written once, over the time, as a share of the measured copy bandwidth."""
    from bench.gpu.peak import timed
    from tinsmith.kernels import delta_rule
    from tinsmith.models.gated_deltanet import recurrent_gated_delta_step

    hk, hv, dk, dv = (2, 4, 16, 16) if quick else (16, 32, 128, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv,
                 "kernel_usable": delta_rule.usable(torch.zeros(1, 1, 1, 1, device=device))}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for rows in ((4,) if quick else (64, 256)):
        q, k = (torch.randn(rows, 1, hk, dk, generator=gen).to(device, dtype) for _ in range(2))
        v = torch.randn(rows, 1, hv, dv, generator=gen).to(device, dtype)
        g = -torch.rand(rows, 1, hv, generator=gen).to(device)
        beta = torch.rand(rows, 1, hv, generator=gen).to(device, dtype)
        store = torch.randn(rows, hv, dk, dv, generator=gen).to(device)
        state_bytes = store.numel() * 4

        def torch_step():
            _, new = recurrent_gated_delta_step(q, k, v, g, beta, store)
            store.copy_(new)

        row: dict = {"state_mbytes": state_bytes / 1e6}
        steps = [("torch", torch_step)]
        if out["kernel_usable"]:
            steps.append(("fused", lambda: delta_rule.decode_step_(q, k, v, g, beta, store)))
        for name, fn in steps:
            store.normal_()  # decays over the repeats: never all zeros, never overflowing
            s = timed(fn, device, repeats=3 if quick else 50)
            row[name] = {"us": s * 1e6, "of_copy_bw": 2 * state_bytes / s / peak["copy_bytes_per_s"]}
        if "fused" in row:
            row["fused_vs_torch"] = row["torch"]["us"] / row["fused"]["us"]
        out[f"rows_{rows}"] = row
    return out


def token_choice(device, peak: dict, quick: bool) -> dict:
    """One decode step's token choice over Qwen3's vocabulary (151,936 entries, bf16 logits,
    temperature 1, no truncation, as a graph-captured step chooses): torch's operations, the
    kernels with one program a row over the whole vocabulary (``one_program_a_row``: the scheme
    before segments) and the kernels by segments (``kernel``, the default), in one process.
    ``of_copy_bw``: the logits read once over the time, as a share of the measured copy bandwidth
    (the segments' read; one program a row reads them twice, torch many more times). Each case
    also says whether the two kernel schemes chose the same tokens (``same_tokens``)."""
    from bench.gpu.peak import timed
    from tinsmith.kernels import token_draw
    from tinsmith.sampling.logits import choose_tokens_masked, uniforms

    vocab = 1000 if quick else 151_936
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"vocab": vocab, "kernel_usable": token_draw.usable(torch.zeros(1, 8, device=device)),
                 "segments": None if token_draw.triton is None else token_draw.segments(vocab, token_draw.BLOCK)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for rows in ((4,) if quick else (64, 256)):
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype)
        t, p = torch.ones(rows, device=device), torch.ones(rows, device=device)
        k = torch.zeros(rows, dtype=torch.long, device=device)
        keys = torch.arange(rows, device=device)
        u = uniforms(keys, keys, keys)
        row: dict = {}
        tokens: dict = {}
        ways = {"torch": ("torch", token_draw.MAX_SEGMENTS)}
        if out["kernel_usable"]:
            ways |= {"one_program_a_row": ("auto", 1), "kernel": ("auto", token_draw.MAX_SEGMENTS)}
        for way, (backend, segments) in ways.items():
            default = token_draw.MAX_SEGMENTS
            token_draw.BACKEND, token_draw.MAX_SEGMENTS = backend, segments
            try:
                choose = lambda: choose_tokens_masked(logits, t, k, p, u, None, False)  # noqa: E731
                tokens[way] = choose()[0].tolist()
                s = timed(choose, device, repeats=3 if quick else 50)
            finally:
                token_draw.BACKEND, token_draw.MAX_SEGMENTS = "auto", default
            row[way] = {"us": s * 1e6, "of_copy_bw": logits.numel() * logits.element_size() / s
                        / peak["copy_bytes_per_s"]}
        if "kernel" in row:
            row["kernel_vs_torch"] = row["torch"]["us"] / row["kernel"]["us"]
            row["kernel_vs_one_program_a_row"] = row["one_program_a_row"]["us"] / row["kernel"]["us"]
            row["same_tokens"] = tokens["kernel"] == tokens["one_program_a_row"]
        out[f"rows_{rows}"] = row
    return out


def lora_gather(device, peak: dict, quick: bool) -> dict:
    """Multi-adapter LoRA at decode: one gathered shrink and expand per projection of a Qwen3-1.7B
    layer (q/k/v packed: in 2048, out 2048+1024+1024; o: 2048 -> 2048; gate/up packed: 2048 ->
    6144+6144; down: 6144 -> 2048), rank 32, rows given the bank's adapters in turn. The shrink before split-K (``split=1``: one
    program per row and rank block walking the whole input, the grid it had) against the split-K
    shrink (its partials added by its last program; ``shrink_torch_sum_us``: by torch in a second
    launch, the way before), in the same process, beside the expand.

    Microseconds per call: on a GPU the mean over 20 calls replayed from one CUDA graph (median of
    5 replays; launched one by one, a call this short times the host's launch, not the GPU), with
    the adapters warm in L2. New/old ratios, a layer's four projections together, the torch gathers
    for scale, and at the first row count the shrink's time by split and the expand's by output
    block width (on a GPU; a CPU's interpreter takes its own width). Each case also checks the
    new pair against the old (``max_rel_diff``) and against itself run twice
    (``bitwise_repeatable``)."""
    from bench.gpu.peak import replayed_us
    from tinsmith.kernels import lora_gather as lg
    from tinsmith.kernels import lora_segments as ls

    if quick:
        hidden, inter, q, kv, rank, rows_list, adapters_list = 64, 160, 64, 32, 4, (4,), (2,)
    else:
        hidden, inter, q, kv, rank, rows_list, adapters_list = 2048, 6144, 2048, 1024, 32, (64, 256), (8, 64)
    projections = {"qkv": (hidden, (q, kv, kv)), "o": (q, (hidden,)), "gate_up": (hidden, (inter, inter)),
                   "down": (inter, (hidden,))}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = lg.triton_available() and (device.type == "cuda" or lg.triton_interpreting())
    out: dict = {"rank": rank, "hidden": hidden, "intermediate": inter, "dtype": str(dtype).split(".")[-1],
                 "kernels_usable": kernels, "shrink_programs": lg.SHRINK_PROGRAMS,
                 "shrink_max_split": lg.SHRINK_MAX_SPLIT}

    def clock(fn) -> float:
        """Microseconds per call of ``fn`` (:func:`bench.gpu.peak.replayed_us`)."""
        return replayed_us(fn, device, quick)

    gen = torch.Generator(device="cpu").manual_seed(0)

    def bank(adapters: int, k: int, outs: tuple[int, ...]):
        parts = len(outs)
        A = (torch.randn(adapters, parts * rank, k, generator=gen) / k**0.5).to(device, dtype)
        B = (torch.randn(adapters, sum(outs), rank, generator=gen) * 0.01).to(device, dtype)
        offsets = None
        if parts > 1:
            offsets = torch.cat([torch.full((o,), j * rank, dtype=torch.int32)
                                 for j, o in enumerate(outs)]).to(device)
        return A, B, offsets

    def pair_torch(y, x, A, B, idx, outs):
        if len(outs) == 1:
            lg.expand_torch(y, lg.shrink_torch(x, A, idx), B, idx)
        else:
            columns = [(sum(outs[:j]), sum(outs[:j + 1])) for j in range(len(outs))]
            lg.expand_parts_torch(y, lg.shrink_torch(x, A, idx), B, idx, columns)

    sweep_rows, sweep_adapters = rows_list[0], adapters_list[0]
    sweep: dict = {}
    expand_sweep: dict = {}
    cpu_block = lg.CPU_MAX_BLOCK
    if device.type == "cpu":
        lg.CPU_MAX_BLOCK = 32  # the interpreter: narrow blocks, so that the quick sizes split too
    try:
        for rows in rows_list:
            for adapters in adapters_list:
                case: dict = {}
                idx = (torch.arange(rows) % adapters).to(device)
                for name, (k, outs) in projections.items():
                    A, B, offsets = bank(adapters, k, outs)
                    x = torch.randn(rows, k, generator=gen).to(device, dtype)
                    y = torch.randn(rows, sum(outs), generator=gen).to(device, dtype)
                    row: dict = {"torch_pair_us": clock(lambda: pair_torch(y, x, A, B, idx, outs))}
                    if kernels:
                        split = lg.shrink_partials_triton(x, A, idx).shape[1]
                        h = lg.shrink_triton(x, A, idx)
                        row["split"] = split
                        row["shrink_old_us"] = clock(lambda: lg.shrink_triton(x, A, idx, 1))
                        row["shrink_new_us"] = clock(lambda: lg.shrink_triton(x, A, idx))
                        row["shrink_new_vs_old"] = row["shrink_new_us"] / row["shrink_old_us"]
                        lg.SUM_IN_KERNEL = False  # the partials added by torch, a second launch (the way before)
                        try:
                            row["shrink_torch_sum_us"] = clock(lambda: lg.shrink_triton(x, A, idx))
                        finally:
                            lg.SUM_IN_KERNEL = True
                        row["kernel_sum_vs_torch_sum"] = row["shrink_new_us"] / row["shrink_torch_sum_us"]
                        row["expand_us"] = clock(lambda: lg.expand_triton(y, h, B, idx, offsets))
                        row["pair_old_us"] = row["shrink_old_us"] + row["expand_us"]
                        row["pair_new_us"] = row["shrink_new_us"] + row["expand_us"]
                        row["pair_new_vs_old"] = row["pair_new_us"] / row["pair_old_us"]
                        base = torch.randn(rows, sum(outs), generator=gen).to(device, dtype)
                        y_old, y_new, y_again = base.clone(), base.clone(), base.clone()
                        lg.expand_triton(y_old, lg.shrink_triton(x, A, idx, 1), B, idx, offsets)
                        lg.expand_triton(y_new, lg.shrink_triton(x, A, idx), B, idx, offsets)
                        lg.expand_triton(y_again, lg.shrink_triton(x, A, idx), B, idx, offsets)
                        delta = (y_old.float() - base.float()).abs().max().clamp(min=1e-30)
                        row["max_rel_diff"] = float((y_new.float() - y_old.float()).abs().max() / delta)
                        row["bitwise_repeatable"] = bool(torch.equal(y_new, y_again))
                        columns = [(sum(outs[:j]), sum(outs[:j + 1])) for j in range(len(outs))]
                        block = ls.expand_block(sum(outs), columns if len(outs) > 1 else None, device.type == "cpu")
                        if block is not None:  # rows sharing an adapter by tiles (SGMV), same process
                            tiles = ls.row_tiles(idx.tolist(), device)
                            h_t = ls.shrink(x, A, tiles)
                            row["tiles"] = tiles.tiles
                            row["segmented_shrink_us"] = clock(lambda: ls.shrink(x, A, tiles))
                            row["segmented_expand_us"] = clock(lambda: ls.expand(y, h_t, B, tiles, offsets, block))
                            row["segmented_pair_us"] = row["segmented_shrink_us"] + row["segmented_expand_us"]
                            row["segmented_vs_new"] = row["segmented_pair_us"] / row["pair_new_us"]
                            y_seg = base.clone()
                            ls.expand(y_seg, ls.shrink(x, A, tiles), B, tiles, offsets, block)
                            row["segmented_max_rel_diff"] = float((y_seg.float() - y_new.float()).abs().max() / delta)
                        if rows == sweep_rows and adapters == sweep_adapters:
                            by_split = {}
                            for s in (1, 2, 4, 8, 16):
                                got = lg.shrink_partials_triton(x, A, idx, s).shape[1]
                                if f"split_{got}" not in by_split:
                                    by_split[f"split_{got}"] = clock(lambda: lg.shrink_triton(x, A, idx, s))
                            by_block = {}
                            default_block = lg.EXPAND_BLOCK
                            try:
                                for width in (64, 128, 256, 512):
                                    lg.EXPAND_BLOCK = width
                                    by_block[f"block_{width}"] = clock(lambda: lg.expand_triton(y, h, B, idx, offsets))
                            finally:
                                lg.EXPAND_BLOCK = default_block
                            sweep[name] = by_split
                            expand_sweep[name] = by_block
                    case[name] = row
                layer: dict = {"torch_us": sum(case[p]["torch_pair_us"] for p in projections)}
                if kernels:
                    layer["old_us"] = sum(case[p]["pair_old_us"] for p in projections)
                    layer["new_us"] = sum(case[p]["pair_new_us"] for p in projections)
                    layer["new_vs_old"] = layer["new_us"] / layer["old_us"]
                    if all("segmented_pair_us" in case[p] for p in projections):
                        layer["segmented_us"] = sum(case[p]["segmented_pair_us"] for p in projections)
                        layer["segmented_vs_new"] = layer["segmented_us"] / layer["new_us"]
                case["layer"] = layer
                out[f"rows_{rows}_adapters_{adapters}"] = case
    finally:
        lg.CPU_MAX_BLOCK = cpu_block
    if sweep:
        out["split_sweep"] = {"rows": sweep_rows, "adapters": sweep_adapters, "shrink_us": sweep,
                              "expand_us_by_block": expand_sweep}
    return out


def kv_layouts(model_dir, device, quick: bool) -> dict:
    """Per-row K/V buffers against pages (CUDA graphs on, base model): decode tokens/s on the
    standard rows, and a mixed batch under a K/V budget that holds every short row but not every
    row at the long one's length (one 4k-token prompt among short ones), with the most rows each
    layout ran at once."""
    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    cfg = lm.config
    width = next(lm.model.parameters()).element_size()
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * width
    rows_n = z["rows"][0]
    long_prompt = 256 if quick else 4096
    budget = rows_n * (z["prompt"] + z["new"] + 128) * per_position + (long_prompt + z["new"] + 128) * per_position
    out: dict = {"short_requests": rows_n, "long_prompt": long_prompt, "kv_budget_mbytes": budget / 1e6}
    for layout in ("rows", "paged"):
        sampler = Sampler(lm.model, lambda toks: "", max_rows=max(z["rows"]), cuda_graphs=True, kv_layout=layout)
        run_sampler(sampler, rows_n, z["prompt"], 4, [None], seed=97)  # warm-up (and first captures)
        row: dict = {}
        for rows in z["rows"]:
            row[f"rows_{rows}_tokens_per_s"] = rows * z["new"] / run_sampler(sampler, rows, z["prompt"], z["new"], [None],
                                                                              seed=rows)
        mixed = Sampler(lm.model, lambda toks: "", max_rows=rows_n + 1, cuda_graphs=True, kv_layout=layout,
                        kv_cache_bytes=budget)
        peak = 0
        real = mixed._decode_step

        def counted(done, mixed=mixed, real=real):
            nonlocal peak
            peak = max(peak, len(mixed.rows))
            real(done)

        mixed._decode_step = counted
        rng = np.random.default_rng(1)
        params = SamplingParams(max_tokens=z["new"], temperature=1.0, stop=[], seed=5)
        mixed.add(SampleTask("long", None, SampleInput(rng.integers(4, 2000, long_prompt), 1, params)))
        for i in range(rows_n):
            mixed.add(SampleTask(i, None, SampleInput(rng.integers(4, 2000, z["prompt"]), 1, params)))
        sync(device)
        t = time.perf_counter()
        finished = 0
        with torch.inference_mode():
            while finished < rows_n + 1:
                for _, res in mixed.step(budget_s=1.0):
                    if isinstance(res, Exception):
                        raise res
                    finished += 1
        sync(device)
        row["mixed_tokens_per_s"] = (rows_n + 1) * z["new"] / (time.perf_counter() - t)
        row["mixed_peak_rows"] = peak
        out[layout] = row
        del sampler, mixed
    out["paged_vs_rows_mixed"] = out["paged"]["mixed_tokens_per_s"] / out["rows"]["mixed_tokens_per_s"]
    del lm
    return out


def fair_share(model_dir, device, quick: bool) -> dict:
    """One key's request of one new token while another key's generations hold every row and end
    together (as the server's sampler runs, in process): its latency and the decode steps it
    waited (a key below its fair share gets a row back after FAIR_SHARE_WAIT_STEPS), the rows
    taken back, and the busy key's tokens/s with the newcomer against alone (a first run pays the
    graph captures)."""
    from tinsmith.sampling.sampler import FAIR_SHARE_WAIT_STEPS

    z = sizes(quick)
    rows, new = max(z["rows"]), max(2 * z["new"], 4 * FAIR_SHARE_WAIT_STEPS)  # the busy rows outlast the wait
    lm = load_model(str(model_dir), device=device)
    sampler = server_sampler(lm.model, device, rows)
    rng = np.random.default_rng(5)

    def busy_run(light: bool) -> dict:
        for i in range(rows):
            params = SamplingParams(max_tokens=new, temperature=1.0, stop=[], seed=i)
            sampler.add(SampleTask(("busy", i), None, SampleInput(rng.integers(4, 2000, z["prompt"]), 1, params), "busy"))
        out: dict = {}
        finished, sent, steps0, yielded0 = 0, None, 0, sampler.stats["yielded_rows"]
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            while finished < rows:
                if light and sent is None and len(sampler.rows) == rows:  # every row decoding
                    params = SamplingParams(max_tokens=1, temperature=1.0, stop=[], seed=7)
                    sampler.add(SampleTask("light", None, SampleInput(rng.integers(4, 2000, z["prompt"]), 1, params),
                                           "light"))
                    sent, steps0 = time.perf_counter(), sampler.stats["decode_steps"]
                for key, res in sampler.step(budget_s=0.05):
                    if isinstance(res, Exception):
                        raise res
                    if key == "light":
                        out["light_s"] = time.perf_counter() - sent
                        out["light_waited_steps"] = sampler.stats["decode_steps"] - steps0
                    else:
                        finished += 1
        sync(device)
        out["busy_tokens_per_s"] = rows * new / (time.perf_counter() - t)
        out["yielded_rows"] = sampler.stats["yielded_rows"] - yielded0
        return out

    busy_run(False)  # the graph captures of every bucket the rows pass through
    alone = busy_run(False)
    together = busy_run(True)
    return {"rows": rows, "new_tokens": new, "wait_steps": FAIR_SHARE_WAIT_STEPS, **together,
            "busy_alone_tokens_per_s": alone["busy_tokens_per_s"],
            "busy_kept": together["busy_tokens_per_s"] / alone["busy_tokens_per_s"]}


def prefix_waves(model_dir, device, quick: bool) -> dict:
    """GRPO groups sent as separate single-sample requests in two waves of the same prompts (the
    second wave arriving after the first finished, as when a batch does not fit the sampler at
    once): the second wave's prompts are in the prefix cache. Per K/V layout (CUDA graphs on):
    the second wave's decode tokens/s, the prompt tokens it computed, and the K/V memory the
    sampler holds at its end (per-row buffers copy a hit into each row and keep the blocks apart;
    pages hold the cached pages in place), with the prefix cache on and off."""
    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    prompts_n, group = (2, 4) if quick else (8, 16)
    rng = np.random.default_rng(3)
    prompt_len = 130 if quick else z["prompt"]  # quick: still two whole 64-token pages
    prompts = [rng.integers(4, 2000, prompt_len) for _ in range(prompts_n)]
    params = SamplingParams(max_tokens=z["new"], temperature=1.0, stop=[], seed=11)
    out: dict = {"prompts": prompts_n, "group": group, "prompt_tokens": prompt_len, "new_tokens": z["new"]}

    def wave(sampler: Sampler, tag: str) -> float:
        for i, p in enumerate(prompts):
            for j in range(group):
                sampler.add(SampleTask((tag, i, j), None, SampleInput(p, 1, params)))
        sync(device)
        t = time.perf_counter()
        finished = 0
        with torch.inference_mode():
            while finished < prompts_n * group:
                for _, res in sampler.step(budget_s=1.0):
                    if isinstance(res, Exception):
                        raise res
                    finished += 1
        sync(device)
        return time.perf_counter() - t

    for layout in ("rows", "paged"):
        for cache in ("on", "off"):
            sampler = Sampler(lm.model, lambda toks: "", max_rows=prompts_n * group, cuda_graphs=True, kv_layout=layout,
                              prefix_cache_bytes=(1 << 30) if cache == "on" else 0, keep_cache_when_idle=True)
            wave(sampler, "first")
            before = sampler.stats["prefill_tokens"]
            seconds = wave(sampler, "second")
            out[f"{layout}/cache_{cache}"] = {
                "second_wave_tokens_per_s": prompts_n * group * z["new"] / seconds,
                "second_wave_prompt_tokens_computed": sampler.stats["prefill_tokens"] - before,
                "kv_mbytes_held": (sampler.cache.nbytes() + sampler.prefix.bytes * (layout == "rows")) / 1e6}
            del sampler
    del lm
    return out
