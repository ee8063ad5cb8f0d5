"""The issues' GPU targets against a bench/gpu run: each figure, its threshold, met or not.

The thresholds are the ones the issues set for one H100 (bf16, LoRA rank 32); a run on another
card (an H200 reads more memory per second) is compared all the same, and says which card it ran
on. A figure the run did not produce (a shape not run, an item skipped or failed) is
"unmeasured", never met.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    part: str  # "train" or "sample"
    item: str  # the part's item key, e.g. "1.7B/lora"
    path: tuple[str, ...]  # into the item's result
    threshold: float
    below: bool = False  # met when the figure is under the threshold (latency), else at or over it
    ratio_of: tuple[str, str, tuple[str, ...]] | None = None  # (part, item, path): the figure divided by this one


TARGETS = (
    Target(12, "first sample call after ready, 1.7B shape (s)", "sample", "1.7B/sdk", ("first_call_s",), 2.0, below=True),
    Target(13, "decode, 64 rows, 1.7B (tok/s)", "sample", "1.7B/decode", ("rows_64", "tokens_per_s"), 25_000),
    Target(13, "decode, 256 rows, 1.7B (tok/s)", "sample", "1.7B/decode", ("rows_256", "tokens_per_s"), 60_000),
    Target(13, "decode, 256 rows, 8B (tok/s)", "sample", "8B/decode", ("rows_256", "tokens_per_s"), 12_000),
    Target(13, "8 adapters vs base model (decode)", "sample", "1.7B/decode", ("adapters_8", "vs_base"), 0.8),
    Target(13, "64 adapters vs base model (decode)", "sample", "1.7B/decode", ("adapters_64", "vs_base"), 0.6),
    Target(13, "GRPO as separate requests vs num_samples", "sample", "1.7B/sdk", ("grpo", "separate_vs_num_samples"), 0.8),
    Target(14, "LoRA 8x1024, 1.7B (MFU 4NT)", "train", "1.7B/lora", ("8x1024", "mfu_4nt"), 0.45),
    Target(14, "LoRA 8x1024, 4B (MFU 4NT)", "train", "4B/lora", ("8x1024", "mfu_4nt"), 0.50),
    Target(14, "LoRA 8x1024, 8B (MFU 4NT)", "train", "8B/lora", ("8x1024", "mfu_4nt"), 0.50),
    Target(14, "4 tenants x 8x1024 in one step vs one tenant's 32x1024, 1.7B", "train", "1.7B/lora",
           ("tenants", "4x8", "vs_one_tenant"), 0.9),
    Target(14, "16 tenants in one step vs one tenant, 1.7B (2x1024 each)", "train", "1.7B/lora", ("tenants", "16", "vs_one_tenant"), 0.8),
    # run within an 80 GB card's memory (the allocator capped there on a larger card)
    Target(14, "1x32k with no flags on 80 GB, 1.7B (MFU 4NT)", "train", "1.7B/lora", ("long_context", "auto_80gb", "mfu_4nt"),
           0.35),
    Target(14, "full fine-tune, 1.7B (MFU 6NT)", "train", "1.7B/full_finetune", ("mfu_6nt",), 0.35),
    # bench/gpu/curves.py: the runtime's bf16 loss curves (one tenant, and among others) strayed from
    # the fp32 plain path's by at most twice what the plain path's own bf16 run did
    Target(14, "SFT loss curves, bf16, 1.7B: straying from fp32 vs the plain bf16 run's (x)", "train", "1.7B/sft_curves",
           ("worst_noise_ratio",), 2.0, below=True),
    Target(14, "LoRA 8x1024 vs transformers+peft, 1.7B (tok/s ratio)", "train", "1.7B/lora", ("8x1024", "tokens_per_s"), 2.5,
           ratio_of=("train", "1.7B/peft_baseline", ("tokens_per_s",))),
)


def _figure(summary: dict, part: str, item: str, path: tuple[str, ...]) -> float | None:
    value = summary.get(part, {}).get(item)
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) else None


def evaluate(summary: dict) -> list[dict]:
    """One row per target: issue, what, figure (None: unmeasured), threshold, met (None: unmeasured)."""
    rows = []
    for t in TARGETS:
        figure = _figure(summary, t.part, t.item, t.path)
        if figure is not None and t.ratio_of is not None:
            base = _figure(summary, *t.ratio_of)
            figure = figure / base if base else None
        met: bool | None = None
        if figure is not None:
            met = figure < t.threshold if t.below else figure >= t.threshold
        rows.append({"issue": t.issue, "what": t.what, "figure": figure, "threshold": t.threshold,
                     "below": t.below, "met": met})
    return rows


def markdown(summary: dict, fmt: Callable[[float], str]) -> list[str]:
    lines = ["## Against the issues' targets (set for one H100)", "",
             "| issue | target | figure | threshold | met |", "|---|---|---|---|---|"]
    for r in evaluate(summary):
        figure = "unmeasured" if r["figure"] is None else fmt(r["figure"])
        met = "-" if r["met"] is None else ("yes" if r["met"] else "no")
        sign = "<" if r["below"] else ">="
        lines.append(f"| {r['issue']} | {r['what']} | {figure} | {sign} {fmt(r['threshold'])} | {met} |")
    return lines + [""]
