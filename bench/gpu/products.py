"""A decode step's products with the weights: torch's (cuBLAS) against the skinny-product kernel
(:mod:`tinsmith.kernels.skinny_matmul`), alone and inside the decode step, in one process.

The kernel is off by default until a GPU shows it faster; this item says whether, and with which
split and block width.
"""

from __future__ import annotations

import torch

from bench.gpu.peak import replayed_us
from bench.gpu.sample import _decode_rate, _switch_compared, sizes
from tinsmith.kernels import skinny_matmul as sk
from tinsmith.kernels.guard import triton_interpreting
from tinsmith.models.loading import load_model
from tinsmith.types import LoraSpec
from tinsmith.worker.runtime import TrainingRuntime

# Weight copies a timed product cycles through: more bytes than an H200's L2 (50 MB), so every call
# reads its weights from HBM as a decode step does.
COPIES_BYTES = 256 << 20


def shapes(quick: bool) -> dict[str, tuple[int, int, str]]:
    """The 1.7B shape's decode products: (in, out, how the weight is stored). q/k/v and gate/up are
    packed ``(in, out)`` buffers; o and down ``(out, in)`` weights read through their transpose,
    as the unembedding (Qwen3-1.7B ties it to the embedding)."""
    if quick:
        return {"qkv": (64, 128, "in_out"), "o": (64, 64, "out_in"), "down": (160, 64, "out_in")}
    return {"qkv": (2048, 4096, "in_out"), "o": (2048, 2048, "out_in"), "gate_up": (2048, 12288, "in_out"),
            "down": (6144, 2048, "out_in"), "unembedding": (2048, 151936, "out_in")}


def products(device, peak: dict, quick: bool) -> dict:
    """Microseconds per product (:func:`bench.gpu.peak.replayed_us`, weights cycled through more
    copies than L2 holds), cuBLAS against the kernel at its default plan, at 64 and 256 rows (quick:
    4 and 8): each one's weight bytes per second and share of the measured copy rate, the kernel's
    time over cuBLAS's (below 1: faster), its largest difference from cuBLAS relative to the
    output's largest value, and at the first row count a sweep of splits and column blocks."""
    kernels = sk.triton_available() and (device.type == "cuda" or triton_interpreting())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_bps = peak["copy_bytes_per_s"] / 2  # the copy rate counts bytes read plus written; products read
    rows_list = sizes(quick)["rows"]
    gen = torch.Generator().manual_seed(0)
    out: dict = {"shape": "tiny" if quick else "1.7B", "dtype": str(dtype).split(".")[-1], "kernels_usable": kernels,
                 "programs": sk.PROGRAMS, "max_split": sk.MAX_SPLIT, "min_k_split": sk.MIN_K_SPLIT,
                 "block_n": sk.BLOCK_N, "block_k": sk.BLOCK_K, "num_warps": sk.NUM_WARPS, "num_stages": sk.NUM_STAGES}
    for name, (k, n, layout) in shapes(quick).items():
        weight_bytes = k * n * (2 if dtype == torch.bfloat16 else 4)
        copies = max(1, min(16, COPIES_BYTES // weight_bytes + 1)) if device.type == "cuda" else 1
        stored = [(torch.randn(k, n, generator=gen) / k ** 0.5).to(device, dtype) for _ in range(copies)]
        ws = stored if layout == "in_out" else [w.t().contiguous().t() for w in stored]
        turn = [0]

        def weight() -> torch.Tensor:
            turn[0] = (turn[0] + 1) % copies
            return ws[turn[0]]

        entry: dict = {"in": k, "out": n, "layout": layout, "weight_copies": copies}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(device, dtype)
            row: dict = {}
            with torch.no_grad():
                row["cublas_us"] = replayed_us(lambda: sk.matmul_torch(x, weight()), device, quick)
                if kernels:
                    row["plan"] = dict(zip(("block_m", "block_n", "block_k", "splits", "k_split"),
                                           sk.plan(rows, n, k, device.type == "cpu")))
                    row["kernel_us"] = replayed_us(lambda: sk.matmul_triton(x, weight()), device, quick)
                    row["kernel_vs_cublas"] = row["kernel_us"] / row["cublas_us"]
                    want = sk.matmul_torch(x.float(), ws[0].float())
                    got = sk.matmul_triton(x, ws[0]).float()
                    row["max_rel_diff"] = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
                    if rows == rows_list[0] and device.type == "cuda":
                        row["sweep_us"] = _sweep(x, weight, n, k, device, quick)
            for key in ("cublas", "kernel"):
                if f"{key}_us" in row:
                    bps = weight_bytes / (row[f"{key}_us"] * 1e-6)
                    row[f"{key}_weight_gb_per_s"] = bps / 1e9
                    row[f"{key}_of_copy_rate"] = bps / copy_bps
            entry[f"rows_{rows}"] = row
        out[name] = entry
    for rows in rows_list:  # a 28-layer step's products (the unembedding once), each way
        layer = [p for p in out if isinstance(out[p], dict) and p != "unembedding" and f"rows_{rows}" in out[p]]
        for key in ("cublas_us", "kernel_us"):
            if layer and all(key in out[p][f"rows_{rows}"] for p in layer):
                total = 28 * sum(out[p][f"rows_{rows}"][key] for p in layer)
                total += out.get("unembedding", {}).get(f"rows_{rows}", {}).get(key, 0.0)
                out[f"step_products_{key}_rows_{rows}"] = total
    return out


def _sweep(x: torch.Tensor, weight, n: int, k: int, device, quick: bool) -> dict:
    """The kernel's microseconds by split (1, 2, 4, 8) at the default column block, by column
    block (32, 128) at the default split, and by blocks of weights in flight (2, 4 stages)."""
    found: dict = {}
    default_block, default_stages = sk.BLOCK_N, sk.NUM_STAGES
    for split in (1, 2, 4, 8):
        got = sk.plan(x.shape[0], n, k, split=split)[3]
        if f"split_{got}" not in found:
            found[f"split_{got}"] = replayed_us(lambda: sk.matmul_triton(x, weight(), None, split), device, quick)
    try:
        for block in (32, 128):
            sk.BLOCK_N = block
            found[f"block_n_{block}"] = replayed_us(lambda: sk.matmul_triton(x, weight()), device, quick)
        sk.BLOCK_N = default_block
        for stages in (2, 4):
            sk.NUM_STAGES = stages
            found[f"stages_{stages}"] = replayed_us(lambda: sk.matmul_triton(x, weight()), device, quick)
    finally:
        sk.BLOCK_N, sk.NUM_STAGES = default_block, default_stages
    return found


def decode_with_kernel(model_dir, device, quick: bool) -> dict:
    """Decode tokens/s with the decode step's products through the kernel (``auto``) and through
    cuBLAS (``torch``), in one process, in the order on, off, on (:func:`bench.gpu.sample._switch_compared`):
    the base model and 8 adapters at the first row count, the base model at the second; then the 8
    adapters once more with the kernel on but each bank's shrink its own launch
    (``adapters_8_shrink_apart_tokens_per_s``; on: taken in the products' launches). On a CPU
    ``auto`` is torch's products too: the same ops both ways (the interpreter would take minutes)."""
    z = sizes(quick)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=8, max_lora_rank=32)
    units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(8)]
    before = sk.BACKEND

    def switch(mode: str) -> None:
        sk.BACKEND = mode

    try:
        first = f"rows_{z['rows'][0]}"
        out = {first: _switch_compared(lm, device, z, z["rows"][0], [("base", [None]), ("adapters_8", units)],
                                       switch, "auto", "torch"),
               f"rows_{z['rows'][1]}": _switch_compared(lm, device, z, z["rows"][1], [("base", [None])], switch,
                                                        "auto", "torch")}
        sk.BACKEND, sk.SHRINK_IN_PRODUCT = "auto", False
        apart = _decode_rate(lm, device, z, z["rows"][0], units)
        on = out[first]["adapters_8"]["on_tokens_per_s"]
        out["adapters_8_shrink_apart"] = {"rows": z["rows"][0], "tokens_per_s": apart,
                                          "shrink_in_product_vs_apart": sum(on) / len(on) / apart}
    finally:
        sk.BACKEND, sk.SHRINK_IN_PRODUCT = before, True
    out["kernel_failed"] = sk.GUARD.failed
    return out
