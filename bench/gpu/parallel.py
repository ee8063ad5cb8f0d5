"""Tensor-, expert- and data-parallel scaling over the GPUs of one machine, in one command.

    python -m bench.gpu.parallel --out DIR [--sizes 1,2,4,8] [--shapes 8B,32B,30B-A3B] [--layouts tp,dp] [--quick]
                                 [--device cuda|cpu]

For each shape and each tensor-parallel size N (at most the GPUs present; on a CPU, gloo
processes): LoRA r32 fwd+bwd tokens/s at 8 x 1024 and its MFU (4NT over the active weight
matrices, against N times the matmul peak measured on rank 0's GPU), sampling tokens/s at 64
rows (128-token prompts, 128 new tokens; decode steps replayed from CUDA graphs, as the server
runs them, each rank's with its collectives inside), and each rank's peak memory. The mixture-of-experts
shape (Qwen3-30B-A3B) runs its experts split over the ranks (expert parallel) and its attention
split by heads.

Weights are random and made on each rank's own device already sharded: the model is built on the
meta device, cut into this rank's shard, and only the shard is materialised. A 32B shape thus
needs neither a checkpoint on disk nor the whole model in any one memory, so the run costs no
downloads and no minutes of writing weights.

``plain`` rows run the same work through the one-process runtime and sampler (no process group,
no sharded layers) in a process of its own: next to the ``tp1`` row it is the cost of the
process-group path itself, which should be nothing.

``dp`` rows (``--data-parallel-size``: a whole replica on each GPU) run M times the work of one:
a step of M x 8 x 1024 tokens whose datums are split over the replicas (logprobs gathered,
gradients summed before the step), and 64 sampling rows on each replica (tokens/s summed). Next to
``plain`` they show how replicas scale; shapes whose bf16 weights take more than 60% of a GPU are
skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu.peak import matmul_flops
from bench.gpu.sample import run_sampler
from bench.gpu.shapes import QWEN3_VOCAB, SHAPES as DENSE_SHAPES
from bench.gpu.train import RANK, batch, step_rate
from tinsmith.models.config import ModelConfig
from tinsmith.models.loading import read_config
from tinsmith.models.layers import CausalLM, Rotary
from tinsmith.models.moe import PackedGateUp, SparseMoeBlock
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.launch import run_ranks
from tinsmith.types import LoraSpec

# name -> transformers config arguments (head_dim 128 unless given); the dense Qwen3 shapes of
# bench/gpu/shapes.py, Qwen3-32B, and Qwen3-30B-A3B (every layer routed: 128 experts, 8 per token).
SHAPES: dict[str, dict] = {
    "8B": {"kind": "qwen3", **DENSE_SHAPES["8B"]},
    "32B": dict(kind="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "30B-A3B": dict(kind="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    # toy bodies on the real vocabulary: the whole run on a CPU in seconds
    "tiny": {"kind": "qwen3", **DENSE_SHAPES["tiny"]},
    "tiny-moe": dict(kind="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32),
}


def config_dir(name: str, root: Path) -> Path:
    """A directory holding only shape ``name``'s config.json (all that :func:`read_config` reads)."""
    import transformers

    s = dict(SHAPES[name])
    kind = s.pop("kind")
    common = dict(vocab_size=QWEN3_VOCAB, max_position_embeddings=40_960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=0, pad_token_id=3, dtype="bfloat16")
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                             architectures=["Qwen3MoeForCausalLM"], **common, **s)
    else:
        config = transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], **common, **s)
    out = root / f"config-{name}"
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(out / "config.json")
    return out


def active_matmul_params(cfg: ModelConfig) -> int:
    """N for MFU: the weight-matrix entries one token passes (routed experts: the ``top_k`` it uses)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    total = 0
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            assert cfg.moe is not None
            total += attention + cfg.moe.num_experts_per_tok * 3 * h * cfg.moe.moe_intermediate_size
        else:
            total += attention + 3 * h * cfg.intermediate_size
    return total + cfg.vocab_size * h


def random_model(cfg: ModelConfig, tp: TPGroup | None, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A randomly initialised model (std 0.02, norms 1), sharded over ``tp`` when given, built so
    that only this rank's shard ever exists on ``device``."""
    from tinsmith.parallel.shard import shard_causal_lm

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    if tp is not None:
        shard_causal_lm(model, tp)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    model.model.rotary = Rotary(cfg.rotary_dim, cfg.rope).to(device)
    for layer in model.model.layers:  # stacked gate/up experts run as one grouped matmul in decode
        if isinstance(layer.mlp, SparseMoeBlock):
            ex = layer.mlp.experts
            ex.packed_gate_up = PackedGateUp(ex.gate_proj, ex.up_proj, ex.activation)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def rank_bench(tp: TPGroup, config_path: str, device_kind: str, layout: str, quick: bool) -> dict:
    """One rank's part of one (shape, layout, size) row, ``layout`` being ``plain`` (one process),
    ``tp`` (sharded) or ``dp`` (replicas); rank 0's dict holds the figures (``dp``: every rank's
    sampling rate counts)."""
    from tinsmith.parallel.replicas import ReplicaTrainingRuntime
    from tinsmith.parallel.runtime import TPTrainingRuntime
    from tinsmith.parallel.sampling import ShardedSampler
    from tinsmith.sampling.sampler import Sampler
    from tinsmith.worker.runtime import TrainingRuntime

    device = torch.device(device_kind if device_kind == "cpu" else f"cuda:{tp.rank}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = read_config(Path(config_path))
    peak = matmul_flops(device, quick) if tp.rank == 0 else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sharded = layout == "tp"
    model = random_model(cfg, tp if sharded else None, device, dtype)
    if layout == "dp":
        rt = ReplicaTrainingRuntime(model, tp, max_lora_adapters=1, max_lora_rank=RANK)
    else:
        rt = (TPTrainingRuntime if sharded else TrainingRuntime)(model, max_lora_adapters=1, max_lora_rank=RANK)
    unit = rt.create_adapter(LoraSpec(rank=RANK, seed=0))  # the same seed on every rank
    rows, length = (2, 32) if quick else (8, 1024)
    if layout == "dp":  # each replica runs 8 x 1024 of the step
        rows *= tp.size
        rt.micro_batch_tokens = max(rt.micro_batch_tokens, rows * length // tp.size)
    train = step_rate(rt, {unit: batch(cfg.vocab_size, rows, length)}, steps=2 if quick else 5)
    sampler_cls = ShardedSampler if sharded else Sampler
    sampler = sampler_cls(model, lambda ids: "", max_rows=64, cuda_graphs=True)  # as served (CUDA only)
    s_rows, prompt, new = (4, 16, 8) if quick else (64, 128, 128)
    # Every rank runs the same decode steps: no time budget (it would differ between ranks).
    run_sampler(sampler, 2, prompt, 4, [None], seed=99, budget_s=math.inf)  # warm-up
    wall = run_sampler(sampler, s_rows, prompt, new, [None], seed=1, budget_s=math.inf)
    out = {"train": train, "sample": {"rows": s_rows, "prompt_tokens": prompt, "new_tokens": new,
                                      "tokens_per_s": s_rows * new / wall},
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if peak is not None:
        out["matmul_peak_flops_per_s"] = peak
    return out


def fits_one_gpu(cfg: ModelConfig, device_kind: str) -> bool:
    """Whether a whole bf16 replica leaves room for activations (its weights under 60% of the GPU)."""
    if device_kind == "cpu":
        return True
    return 2 * cfg.num_params < 0.6 * torch.cuda.get_device_properties(0).total_memory


def run(shape: str, sizes: list[int], device_kind: str, quick: bool, root: Path, deadline_s: float,
        layouts: tuple[str, ...] = ("tp", "dp")) -> dict:
    """Every TP (and DP) size of one shape, plus the one-process ``plain`` row; each in processes
    of its own."""
    path = str(config_dir(shape, root))
    cfg = read_config(Path(path))
    n = active_matmul_params(cfg)
    results: dict = {"active_matmul_params": n}
    rows = [("plain", 1, "plain")]
    rows += [(f"tp{s}", s, "tp") for s in sizes if "tp" in layouts]
    if "dp" in layouts and fits_one_gpu(cfg, device_kind):
        rows += [(f"dp{s}", s, "dp") for s in sizes if s > 1]
    for label, size, layout in rows:
        t = time.perf_counter()
        outcomes = run_ranks(rank_bench, size, root / f"{shape}-{label}", (path, device_kind, layout, quick),
                             timeout_s=300, deadline_s=deadline_s, devices=None if device_kind == "cpu" else
                             [f"cuda:{r}" for r in range(size)])
        failed = [o for o in outcomes if o.exitcode != 0]
        if failed:
            results[label] = {"error": failed[0].error or f"rank {failed[0].rank} exited with {failed[0].exitcode}"}
            continue
        r0 = outcomes[0].result
        tps = r0["train"]["tokens_per_s"]
        results[label] = {
            "ranks": size,
            "train_tokens_per_s": tps,
            "train_mfu_4nt": 4 * n * tps / (size * r0["matmul_peak_flops_per_s"]),
            # replicas sample their own rows at once: their rates add up
            "sample_tokens_per_s": sum(o.result["sample"]["tokens_per_s"] for o in outcomes) if layout == "dp"
            else r0["sample"]["tokens_per_s"],
            "peak_gib_per_rank": [o.result["peak_gib"] for o in outcomes],
            "wall_s": round(time.perf_counter() - t, 1),
        }
    plain, one = results.get("plain", {}), results.get("tp1", {})
    if "train_tokens_per_s" in plain and "train_tokens_per_s" in one:
        results["tp1_vs_plain"] = {"train": one["train_tokens_per_s"] / plain["train_tokens_per_s"],
                                   "sample": one["sample_tokens_per_s"] / plain["sample_tokens_per_s"]}
    return results


def markdown(summary: dict) -> str:
    lines = [f"# Tensor- and data-parallel scaling ({summary['device']}, torch {summary['torch']})", "",
             "| shape | layout | ranks | train tok/s | MFU (4NT) | sample tok/s | peak GiB/rank |",
             "|---|---|---|---|---|---|---|"]
    for shape, rows in summary["shapes"].items():
        for label, r in rows.items():
            if not isinstance(r, dict) or "ranks" not in r and "error" not in r:
                continue
            if "error" in r:
                lines.append(f"| {shape} | {label} | | error: {r['error'].splitlines()[-1][:80]} | | | |")
                continue
            peak = "" if r["peak_gib_per_rank"][0] is None else f"{max(r['peak_gib_per_rank']):.1f}"
            lines.append(f"| {shape} | {label} | {r['ranks']} | {r['train_tokens_per_s']:,.0f} | "
                         f"{100 * r['train_mfu_4nt']:.1f}% | {r['sample_tokens_per_s']:,.0f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: 8B,32B,30B-A3B "
                                                  "with several GPUs; 8B, the TP=1 check, with one)")
    p.add_argument("--sizes", default=None, help="tensor-parallel sizes (default: 1, 2, 4 ... up to the GPUs present)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="small batches (a CPU check of the whole run)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="per row: ranks still running are killed")
    p.add_argument("--layouts", default="tp,dp", help="tp (sharded), dp (replicas) or both")
    a = p.parse_args(argv)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    shapes = [s for s in (a.shapes or ("8B,32B,30B-A3B" if gpus > 1 else "8B")).split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    sizes = ([int(s) for s in a.sizes.split(",")] if a.sizes else
             [s for s in (1, 2, 4, 8) if s <= max(gpus, 1)])
    too_many = [s for s in sizes if a.device == "cuda" and s > gpus]
    if too_many:
        p.error(f"--sizes: {too_many} need more GPUs than the {gpus} present")
    a.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                     "gpus": gpus if a.device == "cuda" else 0, "torch": torch.__version__, "sizes": sizes, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            summary["shapes"][shape] = run(shape, sizes, a.device, a.quick, Path(tmp), a.deadline_s,
                                           tuple(x for x in a.layouts.split(",") if x))
            (a.out / "parallel.json").write_text(json.dumps(summary, indent=2))
    (a.out / "parallel.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
