"""LoRA and full fine-tune fwd+bwd through tinsmith's TrainingRuntime, in-process, and the
transformers + peft baseline on the same batch.

MFU: LoRA counts 4NT FLOPs per step (forward 2NT, backward through activations 2NT, no weight
gradients for the frozen base), full fine-tuning 6NT; N = every weight matrix a token passes
(``shapes.param_counts``), T = tokens. Stated against the measured matmul peak (peak.py).
Both leave out attention's own matmuls, small at 1k tokens and most of the work at 32k: the
fixed-length rows also state ``mfu_with_attention`` (:func:`attention_flops_per_token` added).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.gpu.peak import each_timed, sync, timed
from tinsmith import device_memory
from tinsmith.kernels import norm_grad, swiglu, vocab_softmax
from tinsmith.models import grouped_lora, lora_function
from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import FULL_UNIT, TrainingRuntime, TrainRequest
from tinsmith.worker.service import RuntimeOptions, auto_checkpoint_above, auto_micro_batch_tokens

RANK = 32


def batch(vocab: int, rows: int, length: int, seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        t = rng.integers(4, vocab, length + 1)
        out.append(Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)}))
    return out


def uneven_batch(vocab: int, rows: int, lo: int, hi: int, seed: int = 0) -> list[Datum]:
    """``rows`` sequences of lengths uniform in ``lo..hi`` (as RL rollouts and SFT conversations come)."""
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(lo, hi + 1, rows):
        t = rng.integers(4, vocab, length + 1)
        out.append(Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)}))
    return out


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def training_step(rt: TrainingRuntime, work: dict[int, list[Datum]]) -> Callable[[], None]:
    """One forward_backward over every unit in ``work`` together, then their optimizer steps
    together (as the server takes tenants' steps that arrive together)."""
    reqs = [TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in work.items()]

    def one() -> None:
        for res in rt.forward_backward(reqs):
            if isinstance(res, Exception):
                raise res
        optimizer_steps(rt, list(work), together=True)

    return one


def optimizer_steps(rt: TrainingRuntime, units: list[int], together: bool) -> None:
    """Every unit's AdamW step: all at once (``TrainingRuntime.optim_steps``) or one by one."""
    hp = AdamParams(learning_rate=1e-5)
    if together:
        for res in rt.optim_steps([(u, hp) for u in units]):
            if isinstance(res, Exception):
                raise res
    else:
        for u in units:
            rt.optim_step(u, hp)


def step_rate(rt: TrainingRuntime, work: dict[int, list[Datum]], steps: int) -> dict:
    """tokens/s of forward_backward + optim_step over every unit in ``work`` together, in one pass."""
    tokens = sum(len(x.tokens) for d in work.values() for x in d)
    one = training_step(rt, work)
    reset_peak(rt.device)
    t0 = time.perf_counter()
    one()
    sync(rt.device)
    first = time.perf_counter() - t0
    each = each_timed(one, rt.device, repeats=steps, warmup=1)
    s = sorted(each)[len(each) // 2]
    return {"tokens": tokens, "step_s": s, "tokens_per_s": tokens / s, "first_step_s": first,
            "steps_s": [round(t, 4) for t in each], "peak_gib": peak_memory(rt.device)}


def side_by_side(rt: TrainingRuntime, first: dict[int, list[Datum]], second: dict[int, list[Datum]],
                 pairs: int) -> dict:
    """Two kinds of step (each :func:`training_step`) taken in turns, ``pairs`` pairs after one
    warm step of each, the order swapped every pair (ABBA), each step timed alone between device
    syncs. Host-bound steps drift between measurements a minute apart (four tenants against one
    read 0.55x and 0.77x for the same code on an H200), while neighbouring steps see the same
    machine: ``ratio`` is the median over pairs of the second's tokens/s over the first's, and
    ``ratios`` each pair's, so that a drift shows as a trend and does not move the median."""
    steps = {0: training_step(rt, first), 1: training_step(rt, second)}
    tokens = {k: sum(len(x.tokens) for d in w.values() for x in d) for k, w in ((0, first), (1, second))}
    for one in steps.values():
        one()
    ratios = []
    for i in range(pairs):
        took = {}
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            sync(rt.device)
            t = time.perf_counter()
            steps[k]()
            sync(rt.device)
            took[k] = time.perf_counter() - t
        ratios.append((tokens[1] / took[1]) / (tokens[0] / took[0]))
    return {"ratio": statistics.median(ratios), "ratios": [round(r, 4) for r in ratios]}


def step_phases(rt: TrainingRuntime, work: dict[int, list[Datum]], steps: int) -> dict:
    """Milliseconds of a step's two phases, each ended by a device sync (medians of ``steps``
    after one warm step): the forward/backward of every unit together, then every unit's
    optimizer step, taken together (as the server does) and, on alternate steps, one by one.
    While the host works out an optimizer step the device has little queued, so the second phase
    is mostly the host's time."""
    reqs = [TrainRequest(u, ForwardBackwardInput(d, "cross_entropy")) for u, d in work.items()]
    fb, opt = [], {True: [], False: []}
    for i in range(2 * steps + 2):
        sync(rt.device)
        t0 = time.perf_counter()
        rt.forward_backward(reqs)
        sync(rt.device)
        t1 = time.perf_counter()
        optimizer_steps(rt, list(work), together=i % 2 == 0)
        sync(rt.device)
        if i >= 2:
            fb.append(t1 - t0)
            opt[i % 2 == 0].append(time.perf_counter() - t1)
    together, alone = (1e3 * float(np.median(opt[k])) for k in (True, False))
    return {"forward_backward_ms": 1e3 * float(np.median(fb)), "optimizer_steps_ms": together,
            "optimizer_step_ms_per_unit": together / len(work), "optimizer_steps_alone_ms": alone}


def mfu(tokens_per_s: float, n: int, factor: int, peak: float) -> float:
    return factor * n * tokens_per_s / peak


def attention_flops_per_token(config, seq_len: int) -> float:
    """The FLOPs of causal attention's own matmuls per token of ``seq_len``-token sequences (the
    scores and the weighted sum, forward and the backward through activations; recomputation not
    counted, as MFU never counts it): a token at position t reads t+1 keys, and per layer the
    forward takes 4 x (query width) FLOPs per key read, the backward twice that."""
    return 3 * 4 * config.num_heads * config.head_dim * (seq_len + 1) / 2 * config.num_layers


def with_attention(r: dict, tokens_flops: float, config, seq_len: int, peak: dict) -> dict:
    """``r`` (a step's rate) with ``mfu_with_attention``: ``tokens_flops`` (4N or 6N) plus the
    attention of ``seq_len``-token sequences, per token, against the peak."""
    per_token = tokens_flops + attention_flops_per_token(config, seq_len)
    r["mfu_with_attention"] = per_token * r["tokens_per_s"] / peak["matmul_flops_per_s"]
    return r


def one_tenant_rate(rt: TrainingRuntime, unit: int, rows: int, L: int, steps: int, n: int, peak: dict) -> dict:
    """One tenant's step over ``rows`` x ``L`` random tokens: tokens/s, MFU 4NT, and with attention's matmuls."""
    r = step_rate(rt, {unit: batch(rt.config.vocab_size, rows, L)}, steps)
    r["mfu_4nt"] = mfu(r["tokens_per_s"], n, 4, peak["matmul_flops_per_s"])
    return with_attention(r, 4 * n, rt.config, L, peak)


def lora_headline(model_dir, device, peak: dict, n: int, quick: bool) -> dict:
    """The issue's MFU figure alone: LoRA r32 at 8 x 1024, one tenant (``--headline``: the large
    shapes' targets in a short device call, where :func:`lora`'s every variant would take minutes)."""
    L, rows = (32, 1) if quick else (1024, 8)
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, max_lora_adapters=1, max_lora_rank=RANK)
    try:
        unit = rt.create_adapter(LoraSpec(rank=RANK, seed=0))
        return {"rank": RANK, "seq_len": L, f"{rows}x{L}": one_tenant_rate(rt, unit, rows, L, 2 if quick else 5, n, peak)}
    finally:
        del rt, lm


def lora(model_dir, device, peak: dict, n: int, quick: bool) -> dict:
    """LoRA r32 at 8x1024 and 32x1024 (the first also with the norms, rotary and SiLU-and-multiply
    in torch rather than the training kernels, and with each LoRA op its own autograd node rather
    than one node per projection group: ``lora_function.FUSED_NODES``); 1, 4 and 16 tenants in one step (and the several
    tenants through each way their adapters can run: dense masked products, grouped matmuls in one
    autograd node per projection, grouped matmuls as torch's ops, each tenant's GEMMs in the node);
    padded vs packed micro-batches over uneven lengths; 1x32k long context. Four tenants are also
    measured at 8 x 1024 each against one tenant's 32 x 1024 (issue 14's shape of that target)."""
    L = 32 if quick else 1024
    steps = 2 if quick else 5
    lm = load_model(str(model_dir), device=device)
    vocab = lm.config.vocab_size
    rt = TrainingRuntime(lm.model, max_lora_adapters=16, max_lora_rank=RANK)
    units = [rt.create_adapter(LoraSpec(rank=RANK, seed=i)) for i in range(16)]
    out: dict = {"rank": RANK, "seq_len": L}
    for rows in ((1, 2) if quick else (8, 32)):
        out[f"{rows}x{L}"] = one_tenant_rate(rt, units[0], rows, L, steps, n, peak)
    rows = 2 if quick else 8
    kernels = (norm_grad, swiglu)
    try:
        for k in kernels:
            k.BACKEND = "torch"
        r = step_rate(rt, {units[0]: batch(vocab, rows, L)}, steps)
    finally:
        for k in kernels:
            k.BACKEND = "auto"
    out["torch_elementwise"] = {"shape": f"{rows}x{L}", "tokens_per_s": r["tokens_per_s"], "peak_gib": r["peak_gib"],
                                "kernels_vs_torch": out[f"{rows}x{L}"]["tokens_per_s"] / r["tokens_per_s"]}
    vocab_softmax.BACKEND = "torch"  # the loss's log-sum-exp and softmax gradient in fp32 torch ops
    try:
        r = step_rate(rt, {units[0]: batch(vocab, rows, L)}, steps)
    finally:
        vocab_softmax.BACKEND = "auto"
    out["loss_softmax_in_torch"] = {"shape": f"{rows}x{L}", "tokens_per_s": r["tokens_per_s"], "peak_gib": r["peak_gib"],
                                    "kernels_vs_torch": out[f"{rows}x{L}"]["tokens_per_s"] / r["tokens_per_s"]}
    with cudnn_attention_first():  # SDPA's cuDNN attention before flash (the server turns cuDNN's off)
        r = step_rate(rt, {units[0]: batch(vocab, rows, L)}, steps)
    out["cudnn_attention"] = {"shape": f"{rows}x{L}", "tokens_per_s": r["tokens_per_s"],
                              "first_step_s": r["first_step_s"],
                              "vs_default": r["tokens_per_s"] / out[f"{rows}x{L}"]["tokens_per_s"]}
    lora_function.FUSED_NODES = False  # each LoRA op its own autograd node, as torch's ops run it
    try:
        r = step_rate(rt, {units[0]: batch(vocab, rows, L)}, steps)
    finally:
        lora_function.FUSED_NODES = True
    out["lora_as_ops"] = {"shape": f"{rows}x{L}", "tokens_per_s": r["tokens_per_s"],
                          "nodes_vs_ops": out[f"{rows}x{L}"]["tokens_per_s"] / r["tokens_per_s"]}
    per_tenant = 1 if quick else 2
    tenants = {}
    for k in ((1, 4) if quick else (1, 4, 16)):
        one_unit = step_rate(rt, {units[0]: batch(vocab, per_tenant * k, L)}, steps)
        work = {u: batch(vocab, per_tenant, L, seed=i) for i, u in enumerate(units[:k])}
        many = step_rate(rt, work, steps)
        tenants[str(k)] = {"tokens_per_s": many["tokens_per_s"], "one_tenant_same_tokens_per_s": one_unit["tokens_per_s"],
                           "vs_one_tenant": many["tokens_per_s"] / one_unit["tokens_per_s"],
                           "mfu_4nt": mfu(many["tokens_per_s"], n, 4, peak["matmul_flops_per_s"]),
                           # the step's two phases, each synced: the optimizer steps' share is the host's
                           "phases": step_phases(rt, work, 2 if quick else 3)}
        if k > 1:  # the ways several adapters run, whichever the default picks (grouped_lora.MULTI_LORA);
            # "grouped_ops": grouped with each op its own autograd node (as before lora_tenants' node)
            # "loop": the node's engine of each tenant's GEMMs (no grouped matmul)
            for path in ("dense", "grouped", "grouped_ops", "loop"):
                grouped_lora.MULTI_LORA = path.removesuffix("_ops")
                lora_function.FUSED_NODES = not path.endswith("_ops")
                try:
                    rate = step_rate(rt, work, steps)["tokens_per_s"]
                    tenants[str(k)][f"{path}_vs_one_tenant"] = rate / one_unit["tokens_per_s"]
                finally:
                    grouped_lora.MULTI_LORA = "auto"
                    lora_function.FUSED_NODES = True
            # The default again after the variants, side by side with one tenant step by step:
            # host-bound steps drift between measurements a minute apart (0.55x and 0.77x for the
            # same code on an H200); pairs of neighbouring steps do not.
            paired = side_by_side(rt, {units[0]: batch(vocab, per_tenant * k, L)}, work, steps)
            tenants[str(k)]["vs_one_tenant_paired"] = paired["ratio"]
            tenants[str(k)]["paired_ratios"] = paired["ratios"]
            tenants[str(k)]["steps_s"] = many["steps_s"]
    # The issue's own shape of the four-tenant target: 4 tenants x 8 x 1024 in one step against one
    # tenant's 32 x 1024 (the same tokens), measured side by side.
    rows4 = 1 if quick else 8
    one_unit = step_rate(rt, {units[0]: batch(vocab, 4 * rows4, L)}, steps)
    work = {u: batch(vocab, rows4, L, seed=i) for i, u in enumerate(units[:4])}
    many = step_rate(rt, work, steps)
    paired = side_by_side(rt, {units[0]: batch(vocab, 4 * rows4, L)}, work, steps)
    tenants[f"4x{rows4}"] = {"tokens_per_s": many["tokens_per_s"], "one_tenant_same_tokens_per_s": one_unit["tokens_per_s"],
                             "vs_one_tenant": many["tokens_per_s"] / one_unit["tokens_per_s"],
                             "vs_one_tenant_paired": paired["ratio"], "paired_ratios": paired["ratios"],
                             "mfu_4nt": mfu(many["tokens_per_s"], n, 4, peak["matmul_flops_per_s"]),
                             "phases": step_phases(rt, work, 2 if quick else 3)}
    out["tenants"] = {"rows_per_tenant": per_tenant, "seq_len": L, **tenants}
    # Uneven lengths (uniform in lo..hi), the server's micro-batch size: right-padded rows against
    # packed documents (tokens/s and MFU count real tokens only).
    n_rows, lo, hi = (8, 8, 64) if quick else (32, 256, 2048)
    planned = auto_micro_batch_tokens(lm.config, lm.model, RuntimeOptions())
    rt.micro_batch_tokens = planned
    uneven = {"rows": n_rows, "lengths": f"{lo}..{hi}", "micro_batch_tokens": planned}
    for layout in ("padded", "packed"):
        rt.packing = layout == "packed" and lm.model.supports_packing
        r = step_rate(rt, {units[0]: uneven_batch(vocab, n_rows, lo, hi)}, steps)
        r["mfu_4nt"] = mfu(r["tokens_per_s"], n, 4, peak["matmul_flops_per_s"])
        uneven[layout] = r
    uneven["packed_vs_padded"] = uneven["packed"]["tokens_per_s"] / uneven["padded"]["tokens_per_s"]
    rt.packing = False
    out["packing"] = uneven
    long_len = 128 if quick else 32_768
    out["long_context"] = {"seq_len": long_len}
    # plain: activations kept whole; auto: the server's defaults (micro-batches sized from free
    # memory, recomputation for a micro-batch above that size); checkpointing: always recompute.
    # auto_cudnn: the server's defaults with SDPA's cuDNN attention preferred to flash.
    # auto_80gb: the server's defaults within an 80 GB card's memory (issue 14: "fits on 80 GB with
    # no flags"): on a larger card the allocator is capped there, as --device-memory-fraction does.
    for mode in ("plain", "auto", "checkpointing", "auto_cudnn", "auto_80gb"):
        auto = mode.startswith("auto")
        lm.model.gradient_checkpointing = mode == "checkpointing"
        try:
            with memory_of_80gb_card(rt.device) if mode == "auto_80gb" else contextlib.nullcontext() as capped:
                planned_here = auto_micro_batch_tokens(lm.config, lm.model, RuntimeOptions()) if capped else planned
                rt.micro_batch_tokens = planned_here if auto else 16384
                rt.checkpoint_above_tokens = (auto_checkpoint_above(planned_here, lm.model, RuntimeOptions())
                                              if auto else None)
                rt.oom_retry = mode != "plain"
                with cudnn_attention_first() if mode == "auto_cudnn" else contextlib.nullcontext():
                    r = step_rate(rt, {units[0]: batch(vocab, 1, long_len)}, 1)
            r["mfu_4nt"] = mfu(r["tokens_per_s"], n, 4, peak["matmul_flops_per_s"])
            with_attention(r, 4 * n, lm.config, long_len, peak)
            r["micro_batch_tokens"] = rt.micro_batch_tokens
            if capped:
                r["memory_cap_gib"] = capped / 2**30
        except torch.OutOfMemoryError as e:
            r = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        out["long_context"][mode] = r
    rt.micro_batch_tokens = planned
    lc = out["long_context"]
    if "tokens_per_s" in lc.get("auto_cudnn", {}) and "tokens_per_s" in lc.get("auto", {}):
        lc["cudnn_vs_auto"] = lc["auto_cudnn"]["tokens_per_s"] / lc["auto"]["tokens_per_s"]
    lm.model.gradient_checkpointing = False
    del rt, lm
    return out


# What torch reports as an 80 GB H100's memory (``total_memory``: 79.2 GiB).
CARD_80GB_BYTES = int(79.2 * 2**30)


@contextlib.contextmanager
def memory_of_80gb_card(device: torch.device):
    """Cap the allocator at an 80 GB card's memory while the block runs, on a CUDA device that has
    more (``tinsmith.device_memory``, as ``--device-memory-fraction`` does); yields the cap in
    bytes, or None where nothing is capped (a CPU, or a card no larger)."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    if total <= CARD_80GB_BYTES:
        yield None
        return
    torch.cuda.empty_cache()  # blocks cached by earlier items would count against the cap
    device_memory.limit(device, CARD_80GB_BYTES / total)
    try:
        yield device_memory.cap(device)
    finally:
        device_memory.limit(device, 1.0)


def launch_costs(device, quick: bool) -> dict:
    """What one call of each product several tenants' LoRA makes costs the host and the device, at
    the 1.7B shape's sizes (2,048 rows of 2,048 in four tenants' groups, rank 32): the host's time
    to issue ``calls`` calls back to back (no waiting: what a step bound by its launches pays per
    call) and the device's time per call. ``torch._grouped_mm`` prepares its groups on the host
    (CUTLASS set-up, two allocations, two launches) where a GEMM is one cuBLAS launch: a
    four-tenant step makes ~900 grouped calls, so this says whether they bind it."""
    calls = 20 if quick else 200
    rows, hidden, rank, groups = (256, 256, 32, 4) if quick else (2048, 2048, 32, 4)
    dt = torch.bfloat16
    x = torch.randn(rows, hidden, device=device, dtype=dt)
    A = torch.randn(groups, rank, hidden, device=device, dtype=dt)
    B = torch.randn(groups, hidden, rank, device=device, dtype=dt)
    W = torch.randn(hidden, hidden, device=device, dtype=dt)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
    h = torch.randn(rows, rank, device=device, dtype=dt)
    ops: dict[str, Callable[[], object]] = {
        "mm_base": lambda: torch.mm(x, W.t()),
        "mm_rank": lambda: torch.mm(x, A[0].t()),
        "grouped_shrink": lambda: torch._grouped_mm(x, A.transpose(1, 2), offs=offs),
        "grouped_expand": lambda: torch._grouped_mm(h, B.transpose(1, 2), offs=offs),
    }
    if device.type == "cuda":
        from tinsmith.kernels import lora_gather

        idx = torch.arange(rows, device=device) // (rows // groups)
        if lora_gather.triton_usable(x):
            ops["triton_gathered_shrink"] = lambda: lora_gather.shrink(x, A, idx)
    out: dict = {"rows": rows, "hidden": hidden, "rank": rank, "groups": groups, "calls": calls}
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - t
        sync(device)
        total = time.perf_counter() - t
        out[name] = {"host_us_per_call": 1e6 * host / calls, "wall_us_per_call": 1e6 * total / calls}
    return out


def copies_behind_work(device, quick: bool) -> dict:
    """How long the host waits to copy a few hundred bytes of host data to the device while the
    device is still busy with work queued before it (``torch.cuda._sleep``, about ``busy_ms``):
    ``Tensor.to(non_blocking=True)`` from pageable memory, which CUDA may stage only after the
    stream has drained, against ``tinsmith.transfers.to_device``, which stages the data in
    page-locked memory first. The decode loop and the training step copy host data like this
    (page tables, rows' adapters, offsets): a copy that waits empties the launch queue."""
    from tinsmith.transfers import to_device

    host = np.arange(64, dtype=np.int64)
    cycles = 1 << (24 if quick else 27)  # ~10 / ~80 ms of spinning on an H100/H200 clock
    ways: dict[str, Callable[[], torch.Tensor]] = {
        "pageable_non_blocking": lambda: torch.from_numpy(host).to(device, non_blocking=True),
        "to_device": lambda: to_device(host, device),
    }
    out: dict = {"bytes": host.nbytes}
    for name, copy in ways.items():
        copy()  # the host allocator's first page-locked block out of the way
        waits, busy = [], []
        for _ in range(3 if quick else 5):
            sync(device)
            if device.type == "cuda":  # (a CPU has no queue: its figures are the copies' own cost)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
            t = time.perf_counter()
            got = copy()
            waits.append(1e3 * (time.perf_counter() - t))
            sync(device)
            busy.append(start.elapsed_time(end) if device.type == "cuda" else 0.0)
            assert got.tolist() == host.tolist()
        out[name] = {"host_ms_median": statistics.median(waits), "busy_ms_median": statistics.median(busy)}
    return out


@contextlib.contextmanager
def cudnn_attention_first():
    """SDPA tries cuDNN's attention first, then flash, memory-efficient and math (the flags are
    process-wide, so the backward's threads see them too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        context = sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: the four enabled, in torch's own order
        context = sdpa_kernel(order)
    with context:
        yield


def attention_backends(device, peak: dict, quick: bool) -> dict:
    """Training's causal attention alone, forward and backward, at the 1.7B shape's heads (16 query
    heads over 8 K/V heads of 128), through each of SDPA's fused backends: flash (what training
    takes today), memory-efficient and cuDNN (off in the server, for decoding's sake: it builds a
    plan per new shape), at 8 x 1,024 and 1 x 32,768 tokens, and 8 documents of 1,024 packed in one
    row through ``varlen_attn`` (what packed micro-batches take), as the server runs it and with
    cuDNN allowed first. Per way: ms a forward and
    backward, TFLOP/s (causal: forward 2 x 2 x L^2 / 2 x D a head, backward 2.5 times that), the
    first call's ms (cuDNN's plan) and a second new length's first call. Grouped heads where the
    backend takes them (``enable_gqa``), else K/V repeated per query head (``repeated``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hk, d = (4, 2, 32) if quick else (16, 8, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = ((2, 64), (1, 256)) if quick else ((8, 1024), (1, 32_768))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    out: dict = {"heads": hq, "kv_heads": hk, "head_dim": d, "dtype": str(dtype).split(".")[-1]}
    gen = torch.Generator(device="cpu").manual_seed(0)

    def inputs(b: int, length: int):
        return [torch.randn(b, h, length, d, generator=gen).to(device, dtype).requires_grad_()
                for h in (hq, hk, hk)]

    def run(q, k, v, backend, grouped: bool):
        with sdpa_kernel([backend]):
            if grouped:
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                rep = hq // hk
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
            o.backward(torch.ones_like(o))

    for b, length in cases:
        flops = 3.5 * 2 * b * hq * length * length * d  # causal forward 2 x 2 x L^2/2 x D a head; backward 2.5x
        case: dict = {}
        for name, backend in backends.items():
            q, k, v = inputs(b, length)
            row: dict = {}
            for grouped in (True, False):
                try:
                    sync(device)
                    t = time.perf_counter()
                    run(q, k, v, backend, grouped)
                    sync(device)
                    row["first_call_ms"] = 1e3 * (time.perf_counter() - t)
                    s = timed(lambda: run(q, k, v, backend, grouped), device, repeats=2 if quick else 10)
                    row.update({"ms": 1e3 * s, "tflops": flops / s / 1e12,
                                "of_peak": flops / s / peak["matmul_flops_per_s"], "grouped": grouped})
                    q2, k2, v2 = inputs(b, length - 24)  # a new length: what a plan per shape costs
                    sync(device)
                    t = time.perf_counter()
                    run(q2, k2, v2, backend, grouped)
                    sync(device)
                    row["new_length_first_call_ms"] = 1e3 * (time.perf_counter() - t)
                    row.pop("error", None)
                    break
                except RuntimeError as e:  # this backend cannot serve the shape (or grouped heads)
                    row["error"] = str(e).splitlines()[0][:160]
            case[name] = row
        out[f"{b}x{length}"] = case
    if device.type == "cuda":
        from tinsmith.models.document_attention import _varlen

        found = _varlen()  # (varlen_attn, takes a window, takes grouped heads), as packed training calls it
        if found is not None:
            varlen_attn, takes_window, takes_gqa = found
            docs, length = (2, 64) if quick else (8, 1024)
            total = docs * length
            flops = 3.5 * 2 * docs * hq * length * length * d
            q, k, v = (torch.randn(total, h, d, generator=gen).to(device, dtype).requires_grad_() for h in (hq, hk, hk))
            cu = torch.arange(0, total + 1, length, device=device, dtype=torch.int32)
            kwargs: dict = {"window_size": (-1, 0)} if takes_window else {"is_causal": True}
            if takes_gqa:
                kwargs["enable_gqa"] = True

            def packed():
                kk, vv = (k, v) if takes_gqa else (k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1))
                o = varlen_attn(q, kk, vv, cu, cu, length, length, **kwargs)
                o.backward(torch.ones_like(o))

            # As the server runs it (cuDNN's attention off process-wide), then with cuDNN allowed first
            # (newer torch routes varlen to cuDNN where it is on and can serve the shape).
            case = {}
            for way, context in (("varlen_server", contextlib.nullcontext), ("varlen_cudnn_allowed", cudnn_attention_first)):
                try:
                    with context():
                        s = timed(packed, device, repeats=2 if quick else 10)
                    case[way] = {"ms": 1e3 * s, "tflops": flops / s / 1e12, "of_peak": flops / s / peak["matmul_flops_per_s"]}
                except (RuntimeError, TypeError) as e:
                    case[way] = {"error": str(e).splitlines()[0][:160]}
            out[f"packed_{docs}x{length}"] = case
    return out


def full_finetune(model_dir, device, peak: dict, n: int, quick: bool) -> dict:
    L = 32 if quick else 1024
    lm = load_model(str(model_dir), device=device)
    rt = TrainingRuntime(lm.model, full_finetune=True)
    try:
        r = step_rate(rt, {FULL_UNIT: batch(lm.config.vocab_size, 1 if quick else 8, L)}, 1 if quick else 4)
        r["mfu_6nt"] = mfu(r["tokens_per_s"], n, 6, peak["matmul_flops_per_s"])
        with_attention(r, 6 * n, lm.config, L, peak)
        r["shape"] = f"{1 if quick else 8}x{L}"
        return r
    finally:
        del rt, lm


def peft_baseline(model_dir, device, peak: dict, n: int, quick: bool) -> dict:
    """transformers + peft LoRA r32 on the same projections, the same batch and optimizer."""
    import peft
    import transformers

    L, rows = (32, 1) if quick else (1024, 8)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.as_tensor(np.stack([d.tokens for d in batch(model.config.vocab_size, rows, L)]), device=device)

    def one() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak(device)
    s = timed(one, device, repeats=2 if quick else 5, warmup=1)
    tps = rows * L / s
    return {"shape": f"{rows}x{L}", "tokens_per_s": tps, "mfu_4nt": mfu(tps, n, 4, peak["matmul_flops_per_s"]),
            "peak_gib": peak_memory(device), "transformers": transformers.__version__, "peft": peft.__version__}
