"""Host memory a tensor-parallel rank holds while it loads its shard of a checkpoint.

Every rank of ``--tensor-parallel-size N`` reads the whole checkpoint and keeps its slices. The
files are memory-mapped, so what a rank reads is page cache, held once on the machine however
many ranks map it; what each rank holds privately (anonymous memory, counted N times) is what it
copies. Reported for a random bf16 Qwen3 checkpoint, each case in a process of its own (Linux:
``/proc/self/smaps_rollup``), after freed memory is handed back (``malloc_trim``):

- ``loaded``: private memory after reading the whole model, with the projections packed into
  one buffer per group (the one-process layout, and what ranks did before) and unpacked (what a
  rank does now);
- ``sharded``: private memory once the rank has cut its shard (rank 0 of N) and dropped the rest.

    python bench/tp_load_memory.py [--size 4] [--hidden 1024] [--layers 16] [--json OUT]
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


def private_bytes() -> int:
    """Anonymous memory this process holds, after returning freed heap memory to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split("Private_Dirty:")[1].split()[0]) * 1024


def measure(model_dir: str, size: int, pack: bool) -> dict:
    """In this process: private memory after loading (``pack`` or not) and after sharding."""
    import torch

    from tinsmith.models.loading import load_model
    from tinsmith.parallel.group import TPGroup
    from tinsmith.parallel.shard import shard_causal_lm

    torch.zeros(1)
    start = private_bytes()
    loaded = load_model(model_dir, "cpu", torch.bfloat16, pack=pack)
    after_load = private_bytes() - start
    model = shard_causal_lm(loaded.model, TPGroup(rank=0, size=size))
    del loaded
    after_shard = private_bytes() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"loaded_mb": after_load / MB, "sharded_mb": after_shard / MB, "shard_params_mb": shard / MB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4, help="tensor-parallel size (this process is rank 0)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # model_dir pack
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.size, args.child[1] == "1")))
        return
    from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        shape = TinyShape(vocab_size=8192, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                          num_key_value_heads=max(args.size, 4), head_dim=64)
        model_dir = make_tiny_model(Path(tmp) / "model", shape=shape, dtype="bfloat16")
        checkpoint = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / MB
        os.sync()  # pages of a file just written count as dirty, as if a reader had copied them
        rows = {}
        for pack in (True, False):
            out = subprocess.run([sys.executable, __file__, "--size", str(args.size), "--child", str(model_dir),
                                  "1" if pack else "0"], capture_output=True, text=True, check=True)
            rows["packed" if pack else "unpacked"] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"checkpoint {checkpoint:.0f} MB (bf16), rank 0 of {args.size}")
    print(f"{'load':>9} {'private after load MB':>22} {'private after shard MB':>23} {'shard params MB':>16}")
    for name, r in rows.items():
        print(f"{name:>9} {r['loaded_mb']:>22.0f} {r['sharded_mb']:>23.0f} {r['shard_params_mb']:>16.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint_mb": checkpoint, "size": args.size, **rows}, indent=2))


if __name__ == "__main__":
    main()
