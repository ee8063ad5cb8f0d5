"""Host memory a tensor-parallel rank holds while it loads its shard of a checkpoint.

Every rank of ``--tensor-parallel-size N`` reads the whole checkpoint and keeps its slices. The
files are memory-mapped, so what a rank reads is page cache, held once on the machine however
many ranks map it; what each rank holds privately (anonymous memory, counted N times over) is
what it copies. Measured for random bf16 checkpoints (a dense Qwen3, and a Qwen3-MoE whose
experts are stored one tensor each, as released, and stacked on load), rank 0 of N, each way of
loading in a process of its own (Linux: ``/proc/self/smaps_rollup``, after freed memory is
handed back with ``malloc_trim``):

- ``packed``: the whole model read with its projections packed into one buffer per group, then
  cut (how ranks loaded before);
- ``whole``: the whole model read unpacked, then cut;
- ``by layer``: :func:`tinsmith.parallel.shard.load_shard`, each layer cut as soon as it is read.

``peak`` is the most private memory seen while loading (for ``by layer``: checked before and
after each layer is cut), ``kept`` what is held once the rank has its shard.

    python bench/tp_load_memory.py [--size 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 2**20
WAYS = ("packed", "whole", "by layer")


def private_bytes() -> int:
    """Anonymous memory this process holds, after returning freed heap memory to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split("Private_Dirty:")[1].split()[0]) * 1024


def measure(model_dir: str, size: int, way: str) -> dict:
    """In this process: the peak and kept private memory of loading rank 0's shard ``way``."""
    import torch

    from tinsmith.models.loading import load_model
    from tinsmith.parallel.group import TPGroup
    from tinsmith.parallel.shard import shard_causal_lm, shard_layer, shard_root

    tp = TPGroup(rank=0, size=size)
    torch.zeros(1)
    start = private_bytes()
    seen = [0]

    def note() -> None:
        seen[0] = max(seen[0], private_bytes() - start)

    if way == "by layer":  # load_shard, with the memory checked around each layer's cut
        def cut(model, i: int) -> None:
            note()
            shard_layer(model, i, tp)
            note()

        model = shard_root(load_model(model_dir, "cpu", torch.bfloat16, pack=False, on_layer=cut).model, tp)
    else:
        model = load_model(model_dir, "cpu", torch.bfloat16, pack=way == "packed").model
        note()
        model = shard_causal_lm(model, tp)
    note()
    kept = private_bytes() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_mb": seen[0] / MB, "kept_mb": kept / MB, "shard_mb": shard / MB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4, help="tensor-parallel size (this process is rank 0)")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # model_dir way
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.size, args.child[1])))
        return
    from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model

    shapes = {
        "qwen3": TinyShape(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=max(args.size, 4), head_dim=64),
        "qwen3_moe": TinyShape(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=max(args.size, 4), head_dim=64,
                               num_experts=64, num_experts_per_tok=4, moe_intermediate_size=384),
    }
    out: dict = {"size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        for family, shape in shapes.items():
            model_dir = make_tiny_model(Path(tmp) / family, family=family, shape=shape, dtype="bfloat16")
            checkpoint = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / MB
            os.sync()  # pages of a file just written count as dirty, as if a reader had copied them
            rows = {}
            for way in WAYS:
                res = subprocess.run([sys.executable, __file__, "--size", str(args.size), "--child", str(model_dir),
                                      way], capture_output=True, text=True, check=True)
                rows[way] = json.loads(res.stdout.strip().splitlines()[-1])
            out[family] = {"checkpoint_mb": checkpoint, **rows}
            print(f"{family}: checkpoint {checkpoint:.0f} MB (bf16), rank 0 of {args.size}")
            print(f"{'load':>10} {'peak private MB':>16} {'kept private MB':>16} {'shard MB':>9}")
            for way, r in rows.items():
                print(f"{way:>10} {r['peak_mb']:>16.0f} {r['kept_mb']:>16.0f} {r['shard_mb']:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
