"""Run the GPU benchmarks and write their results: one JSON per part, summary.json, summary.md.

    python -m bench.gpu.run --out DIR [--shapes 1.7B] [--quick] [--device cuda|cpu]

Parts: ``peak`` (the machine's measured ceilings), ``train`` (LoRA / full fine-tune / peft
baseline, the kernels of a training step: profile.py, a real SFT run's loss curves against the
plain path: curves.py), ``sample`` (and the kernels of a decode step) (decode vs the HBM bound, 8 adapters, generate baseline, SDK GRPO and
first-call latency, decode stall while a long prompt is prefilled whole vs chunked), ``moe`` (a Qwen3-30B-A3B-sized layer stack against the dense model of
equal active parameters). Each item runs guarded: a failure is recorded and the rest still run. Each
part has a time budget; items that would start after it are recorded as skipped, so the whole
stays inside one device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu import peak as peak_mod
from bench.gpu import curves, moe, products, profile, sample, targets, train
from tinsmith.worker.warm_up import configure_device
from bench.gpu.report import markdown
from bench.gpu.shapes import SHAPES, checkpoint, param_counts, qwen3_config
from tinsmith.gc_tuning import tuned_for_serving
from tinsmith.host_malloc import tune_for_serving as tune_malloc
from tinsmith.server.logs import http_stack

# seconds per part on an H100 (tests take the rest of the 10-minute call)
BUDGET_S = {"peak": 30, "train": 200, "sample": 200, "moe": 60}


class Part:
    """Collects one part's items; ``item`` runs a measurement unless the part's budget is spent."""

    def __init__(self, name: str, budget_s: float, run_deadline: float = float("inf"), only: tuple[str, ...] = ()):
        self.name, self.results = name, {}
        self.deadline = min(time.monotonic() + budget_s, run_deadline)
        self.only = only  # item keys must contain one of these (empty: every item runs)

    def wanted(self, key: str) -> bool:
        """Whether ``--only`` names this item: a word matches keys holding it, ``word$`` only the key itself."""
        return not self.only or any(key == w[:-1] if w.endswith("$") else w in key for w in self.only)

    def item(self, key: str, fn: Callable[[], dict]) -> None:
        if not self.wanted(key):
            return
        if time.monotonic() > self.deadline:
            self.results[key] = {"skipped": f"the {self.name} part's time budget was spent"}
            return
        t = time.perf_counter()
        counts = _allocator_counts()
        try:
            self.results[key] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the other items still run
            self.results[key] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                 "traceback": traceback.format_exc()[-3000:]}
        self.results[key]["wall_s"] = round(time.perf_counter() - t, 2)
        after = _allocator_counts()
        if counts is not None and after is not None:  # cudaFree calls inside the item: each a wait for the device
            self.results[key]["allocator"] = {"retries": after[0] - counts[0], "device_frees": after[1] - counts[1]}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _allocator_counts() -> tuple[int, int] | None:
    """The caching allocator's retries (cached blocks given back to fit an allocation) and cudaFree
    calls so far, on the current CUDA device (None without one). The items' own
    ``torch.cuda.empty_cache()`` between them is not counted."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_free", 0))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    # 1.7B alone by default: the issues' targets are set on it, and one device call holds one shape's parts.
    p.add_argument("--shapes", default="1.7B", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="small batches and lengths (a CPU check of the whole run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default="train,moe,sample", help="run in this order; peak always runs first")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TINSMITH_BENCH_CACHE",
                                                                         Path(tempfile.gettempdir()) / "tinsmith-bench")))
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    p.add_argument("--only", default="", help="comma-separated: run only the items whose key holds one of these "
                                               "(e.g. replay_profile,lora_gather; '1.7B/decode$' names that key alone): "
                                               "a short device call's re-measurement")
    p.add_argument("--headline", action="store_true",
                   help="per shape only the issues' target figures (LoRA 8x1024 MFU; decode at 64 and 256 rows): "
                        "the large shapes in a short device call")
    p.add_argument("--headline-shapes", default="",
                   help="comma-separated shapes run as --headline runs them, beside the full --shapes in one call: "
                        "after the full shapes' target items and before their diagnostics, each checkpoint made "
                        "when its first item runs (e.g. --shapes 1.7B --headline-shapes 4B,8B)")
    p.add_argument("--max-wall-s", type=float, default=float("inf"),
                   help="no item starts after this many seconds (so a run under an outer timeout still writes its summary)")
    a = p.parse_args(argv)
    run_deadline = time.monotonic() + a.max_wall_s
    only = tuple(w for w in a.only.split(",") if w)
    shapes = [s for s in a.shapes.split(",") if s]
    extra = [s for s in a.headline_shapes.split(",") if s]
    for flag, names in (("--shapes", shapes), ("--headline-shapes", extra)):
        if unknown := [s for s in names if s not in SHAPES]:
            p.error(f"{flag}: unknown {unknown}; choose from {list(SHAPES)}")
    if both := [s for s in extra if s in shapes]:
        p.error(f"--headline-shapes: {both} also in --shapes; a shape runs one way")
    # Full shapes run every item; headline shapes only the targets' figures (all of them with --headline).
    full, headline = ([], shapes + extra) if a.headline else (shapes, extra)
    parts = [x for x in a.parts.split(",") if x and x != "peak"]
    if unknown_parts := [x for x in parts if x not in ("train", "sample", "moe")]:
        p.error(f"--parts: unknown {unknown_parts}; choose from train, sample, moe (peak always runs)")
    device = torch.device(a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    configure_device(device)  # the server's process-wide switches (cuDNN's attention off), for in-process items too
    summary: dict = {"device": a.device, "quick": a.quick, "shapes": shapes + extra, "headline_shapes": headline,
                     "torch": torch.__version__, "http_stack": http_stack(),
                     "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(), "glibc_malloc": MALLOC}

    pk = Part("peak", BUDGET_S["peak"] * a.budget_scale)  # always: every figure needs it
    pk.item("machine", lambda: peak_mod.measure(device, a.quick))
    peaks = pk.results["machine"]
    summary["peak"] = peaks
    (a.out / "peak.json").write_text(json.dumps(pk.results, indent=2))
    if "error" in peaks:
        summary["wall_s"] = time.perf_counter() - started
        (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    dirs: dict[str, Path] = {name: checkpoint(name, a.cache_dir, a.device) for name in shapes}

    def model_dir(name: str) -> Path:
        """The shape's checkpoint; a headline shape's is made here, inside its first item (whose
        time and budget it takes), so that a shape whose items are all skipped costs nothing."""
        if name not in dirs:
            dirs[name] = checkpoint(name, a.cache_dir, a.device)
        return dirs[name]

    counts = {name: param_counts(qwen3_config(name)) for name in shapes + extra}
    summary["params"] = counts

    def run_train() -> None:
        # The targets' items first, then the headline shapes', then the diagnostics: a call that
        # runs long loses what explains the figures, never the figures.
        tr = Part("train", BUDGET_S["train"] * a.budget_scale, run_deadline, only)
        curve_shape = "1.7B" if "1.7B" in full else (full or [None])[0]  # its fp32 runs are slow on the large shapes
        for name in full:
            n = counts[name]["matmul"]
            tr.item(f"{name}/lora", lambda: train.lora(dirs[name], device, peaks, n, a.quick))
            tr.item(f"{name}/peft_baseline", lambda: train.peft_baseline(dirs[name], device, peaks, n, a.quick))
            if name == curve_shape:  # the loss curves of a real SFT run, fast path against plain (one shape)
                tr.item(f"{name}/sft_curves", lambda: curves.sft_curves(dirs[name], device, a.quick))
            if name in ("tiny", "0.6B", "1.7B"):  # a bf16 full copy + AdamW state of 4B/8B does not fit beside the rest
                tr.item(f"{name}/full_finetune", lambda: train.full_finetune(dirs[name], device, peaks, n, a.quick))
        for name in headline:  # the issues' figure alone: one tenant's 8 x 1024
            tr.item(f"{name}/lora", lambda: train.lora_headline(model_dir(name), device, peaks, counts[name]["matmul"],
                                                                a.quick))
        if full:  # why the figures are what they are: the step's kernels and host, launches, copies, attention
            tr.item(f"{full[-1]}/profile", lambda: profile.train_step(dirs[full[-1]], device, a.quick))
            tr.item("launch_costs", lambda: train.launch_costs(device, a.quick))
            tr.item("copies_behind_work", lambda: train.copies_behind_work(device, a.quick))
            tr.item("attention_backends", lambda: train.attention_backends(device, peaks, a.quick))
        summary["train"] = tr.results
        (a.out / "train.json").write_text(json.dumps(tr.results, indent=2))

    def sample_items(sa: Part) -> None:
        big = full[-1]
        # The targets' figures first (decode vs the HBM bound with 8 and 64 adapters, the SDK's
        # first call and GRPO), then the headline shapes' decode, then what explains them, so that
        # a run cut short still has the figures.
        for name in full:
            sa.item(f"{name}/decode", lambda: sample.in_process(dirs[name], device, peaks, a.quick))
            sa.item(f"{name}/sdk", lambda: sample.through_sdk(dirs[name], device, a.quick,
                                                              Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))))
        headline_decode(sa)
        sa.item(f"{big}/decode_profile", lambda: profile.decode_step(dirs[big], device, a.quick))
        sa.item(f"{big}/replay_profile", lambda: profile.decode_replayed(dirs[big], device, a.quick))
        sa.item(f"{big}/decode_bursts", lambda: sample.decode_bursts(dirs[big], device, a.quick))
        sa.item(f"{big}/dependent_launches", lambda: sample.dependent_launches(dirs[big], device, a.quick))
        sa.item(f"{big}/expands_in_kernels", lambda: sample.expands_in_kernels(dirs[big], device, a.quick))
        sa.item(f"{big}/decode_skinny", lambda: products.decode_with_kernel(dirs[big], device, a.quick))
        # the SDK on pyqwest, as the hosted service leaves it: its client CPU a request
        sa.item(f"{big}/sdk_pyqwest", lambda: sample.through_sdk(
            dirs[big], device, a.quick, Path(tempfile.mkdtemp(prefix=f"bench-{big}-")), transport="pyqwest"))
        for name in full:
            sa.item(f"{name}/generate_baseline", lambda: sample.generate_baseline(dirs[name], device, a.quick))
        sa.item(f"{big}/beside_training", lambda: sample.beside_training(
            dirs[big], device, a.quick, Path(tempfile.mkdtemp(prefix=f"bench-{big}-"))))
        sa.item(f"{big}/fair_share", lambda: sample.fair_share(dirs[big], device, a.quick))
        # Then the components, on the largest shape only: decode attention and K/V layouts, a
        # Qwen3.5-shaped Gated DeltaNet step, the token choice and the multi-adapter LoRA kernels
        # (1.7B's projections), prefix waves, chunked prefill; graphs against eager
        # (its eager runs are the longest item) last.
        sa.item(f"{big}/decode_attention", lambda: sample.decode_attention(dirs[big], device, peaks, a.quick))
        sa.item("qwen3_5/delta_rule_step", lambda: sample.delta_rule_step(device, peaks, a.quick))
        sa.item("token_choice", lambda: sample.token_choice(device, peaks, a.quick))
        sa.item("lora_gather", lambda: sample.lora_gather(device, peaks, a.quick))
        sa.item("skinny_products", lambda: products.products(device, peaks, a.quick))
        sa.item(f"{big}/kv_layout", lambda: sample.kv_layouts(dirs[big], device, a.quick))
        sa.item(f"{big}/prefix_waves", lambda: sample.prefix_waves(dirs[big], device, a.quick))
        sa.item(f"{big}/chunked_prefill", lambda: sample.chunked_prefill(dirs[big], device, a.quick))
        sa.item(f"{big}/cuda_graphs", lambda: sample.graphs_vs_eager(dirs[big], device, a.quick))

    def headline_decode(sa: Part) -> None:
        """The headline shapes' decode at each row count, no adapters (the targets' figures)."""
        for name in headline:
            sa.item(f"{name}/decode", lambda: sample.in_process(model_dir(name), device, peaks, a.quick, adapters=False))

    def run_sample() -> None:
        sa = Part("sample", BUDGET_S["sample"] * a.budget_scale, run_deadline, only)
        if full:
            sample_items(sa)
        else:
            headline_decode(sa)
        summary["sample"] = sa.results
        (a.out / "sample.json").write_text(json.dumps(sa.results, indent=2))

    def run_moe() -> None:
        mo = Part("moe", BUDGET_S["moe"] * a.budget_scale, run_deadline, only)
        mo.item("a3b_vs_dense", lambda: moe.moe_vs_dense(a.cache_dir, device, peaks, a.quick, layers=2 if a.quick else 4))
        summary["moe"] = mo.results
        (a.out / "moe.json").write_text(json.dumps(mo.results, indent=2))

    # In the order asked: a device call split in two runs ``--parts train,moe`` then ``--parts sample``.
    # The in-process items run the worker as `tinsmith serve` runs it, garbage collection included.
    with tuned_for_serving() as frozen:
        summary["gc_frozen_objects"] = frozen
        for part in parts:
            {"train": run_train, "sample": run_sample, "moe": run_moe}[part]()

    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["targets"] = targets.evaluate(summary)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (a.out / "summary.md").write_text(md)
    print(md)
    return summary


MALLOC = "as the process found it"  # glibc's allocator: what `python -m bench.gpu.run` set, for the summary

if __name__ == "__main__":
    # As `tinsmith serve` does, before the run starts threads (tinsmith.host_malloc): the in-process
    # items' host tensors then come and go as the server's do. Not on import: a test's process keeps its own.
    MALLOC = "tuned for serving" if (why := tune_malloc()) is None else f"left alone: {why}"
    main()
