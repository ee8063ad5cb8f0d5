"""Micro-benchmark: the host's time for one training step of 1, 4 and 16 tenants sharing it.

On a GPU several tenants' step is bound by the host (docs/performance.md): what the host does
per tenant and per layer (Python, launches) is what the device waits for. On a model of tiny
widths the CPU's kernels cost little, so the wall time of a step here is mostly that host work.
This times one forward/backward of every tenant together (8 rows of 16 tokens shared among them)
and then the tenants' optimizer steps (one by one, then together as the server takes steps that
arrive together), on Qwen3-1.7B's 28 layers at tiny widths, LoRA rank 32 on every linear layer,
with the multi-tenant paths a GPU takes (the grouped matmul and the fused AdamW, forced here)
and Python's garbage collector tuned as the server tunes it; medians of ``--steps`` steps after
two warm ones, one thread. ``--widths 16`` shrinks the model's widths to 16 (rank 8): the CPU's
kernels then cost almost nothing and what is timed is nearly all host work.

Two more columns separate the host's own work from what this CPU computes where a GPU would only
launch: ``grouped_mm_ms``, the forward/backward's time inside ``torch._grouped_mm`` (here a loop
over the groups in C++; on a GPU a CUTLASS set-up and two launches a call), and
``optimizer_host_ms``, the optimizer steps taken together again with the multi-tensor kernels
(norms, AdamW, copies, multiplies) and the strided block copies skipped: what remains is the
Python and the dispatch a GPU's host spends on them apart from the launches themselves. The
weights do not move in those steps, so they are timed after the others.

``--nodes-from REV`` compares the several-tenant nodes (``tinsmith/models/lora_tenants.py``) of
commit ``REV`` with this checkout's in one process instead: both modules loaded side by side, the
model's layers switched between them round after round, each round's forward/backward timed less
its grouped matmuls (the host's own work), optimizer steps taken together between steps.
``--single-steps`` times one tenant's optimizer step both ways a step alone can go: torch's
optimizer (``Trainable.step``, its ``step()`` finding each tensor's state and gradient in Python)
and the runtime's ``optim_step`` (the joint step's kernel calls on the unit's kept lists), each in
full and with the kernels skipped, alternated in one process.
``--steps-from REV`` does the same for the several tenants' joint optimizer steps: commit ``REV``'s
``step_together`` (``tinsmith/worker/joint_steps.py``) and compute copies' key writing
(``CopyRefresh._write_keys``) against this checkout's, each timed in full and with the kernels
skipped (the rest of the step, the units and their refresh lists, are this checkout's in both).

    python bench/tenants_step_micro.py [--tenants 1,4,16] [--steps 10] [--dtype fp32|bf16] [--json out.json]
    python bench/tenants_step_micro.py --nodes-from HEAD~1 [--tenants 4,16] [--rounds 6] [--steps 4]
    python bench/tenants_step_micro.py --steps-from HEAD~1 [--tenants 4,16] [--rounds 6] [--steps 4]
    python bench/tenants_step_micro.py --single-steps [--rounds 6] [--steps 4]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.train import batch, optimizer_steps  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.gc_tuning import tuned_for_serving  # noqa: E402
from tinsmith.kernels import block_copy  # noqa: E402
from tinsmith.models import copy_refresh, grouped_lora, lora, lora_tenants, moe  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.optim import families  # noqa: E402
from tinsmith.types import ForwardBackwardInput, LoraSpec  # noqa: E402
from tinsmith.worker import runtime as runtime_module  # noqa: E402
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest  # noqa: E402


def time_steps(rt: TrainingRuntime, tenants: int, steps: int, rows: int = 8, length: int = 16, rank: int = 32,
               together: bool = True) -> dict:
    """Median ms of the forward/backward, of all tenants' optimizer steps (taken together, as the
    server takes steps that arrive together, or one by one), and of both."""
    units = [rt.create_adapter(LoraSpec(rank=rank, seed=i)) for i in range(tenants)]
    per = max(1, rows // tenants)
    requests = [TrainRequest(u, ForwardBackwardInput(batch(rt.config.vocab_size, per, length, seed=i), "cross_entropy"))
                for i, u in enumerate(units)]
    fb, opt, grouped, host = [], [], [], []
    for i in range(steps + 2):  # two warm steps: layouts, stacks, optimizer state
        with grouped_mm_timer() as in_grouped:
            t0 = time.perf_counter()
            rt.forward_backward(requests)
            t1 = time.perf_counter()
        optimizer_steps(rt, units, together)
        if i >= 2:
            fb.append(t1 - t0)
            opt.append(time.perf_counter() - t1)
            grouped.append(in_grouped[0])
    if together:
        for _ in range(steps):
            rt.forward_backward(requests)
            with optimizer_kernels_skipped():
                t0 = time.perf_counter()
                optimizer_steps(rt, units, True)
                host.append(time.perf_counter() - t0)
    for u in units:
        rt.delete_adapter(u)
    out = {"forward_backward_ms": 1e3 * statistics.median(fb), "optimizer_steps_ms": 1e3 * statistics.median(opt),
           "step_ms": 1e3 * statistics.median(a + b for a, b in zip(fb, opt)),
           "grouped_mm_ms": 1e3 * statistics.median(grouped)}
    if host:
        out["optimizer_host_ms"] = 1e3 * statistics.median(host)
    return out


@contextlib.contextmanager
def grouped_mm_timer():
    """Seconds spent inside ``torch._grouped_mm`` while the block runs (``[seconds]``, filled as it goes)."""
    spent = [0.0]
    original = torch._grouped_mm

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    torch._grouped_mm = timed
    try:
        yield spent
    finally:
        torch._grouped_mm = original


# The multi-tensor kernels of a joint optimizer step (tinsmith.worker.joint_steps, copy_refresh).
_STEP_KERNELS = ("_foreach_copy_", "_foreach_add_", "_foreach_mul_", "_fused_adamw_")


@contextlib.contextmanager
def optimizer_kernels_skipped():
    """The optimizer steps' multi-tensor kernels and strided block copies made no-ops (the norms
    zeros), so that timing a step times the host's own work: the weights do not change inside."""
    saved = {name: getattr(torch, name) for name in (*_STEP_KERNELS, "_foreach_norm")}
    run = block_copy.BlockCopies.run
    zero = torch.zeros(())
    for name in _STEP_KERNELS:
        setattr(torch, name, lambda *args, **kwargs: None)
    torch._foreach_norm = lambda tensors, *args, **kwargs: [zero] * len(tensors)
    block_copy.BlockCopies.run = lambda self: None
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        block_copy.BlockCopies.run = run


def measure(rt: TrainingRuntime, args, results: dict) -> None:
    """Each tenant count's steps, optimizer steps alone and together, printed and put in ``results``."""
    w = args.widths
    for n in (int(t) for t in args.tenants.split(",")):
        results[n] = {}
        for how in ("alone", "together"):  # the optimizer steps one by one, then together
            results[n][how] = r = time_steps(rt, n, args.steps, rank=32 if w > 16 else 8, together=how == "together")
            host = (f"; host alone {r['optimizer_host_ms']:6.1f}: {r['optimizer_host_ms'] / n:5.2f} a tenant"
                    if "optimizer_host_ms" in r else "")
            print(f"{n:>3} tenants, optimizer steps {how:>8}: step {r['step_ms']:7.1f} ms (forward/backward "
                  f"{r['forward_backward_ms']:6.1f}, of it grouped matmuls {r['grouped_mm_ms']:5.1f}; optimizer "
                  f"steps {r['optimizer_steps_ms']:6.1f}: {r['optimizer_steps_ms'] / n:5.1f} a tenant{host})",
                  flush=True)


def module_of(rev: str, path: str, into: Path):
    """The module at ``path`` (``tinsmith/...py``) as commit ``rev`` has it, loaded beside this
    checkout's (under a name of its own; what it imports is this checkout's)."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"{rev}: git cannot show {path} at that commit ({shown.stderr.strip()})")
    name = Path(path).stem + "_then"
    file = into / f"{name}.py"
    file.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def nodes_of(rev: str, into: Path):
    """The several-tenant nodes' module as commit ``rev`` has it, loaded beside this checkout's."""
    return module_of(rev, "tinsmith/models/lora_tenants.py", into)


def compare_steps(rt: TrainingRuntime, args, into: Path, results: dict) -> None:
    """``--steps-from``: each tenant count's joint optimizer steps with commit ``REV``'s
    :func:`tinsmith.worker.joint_steps.step_together` and its compute copies' key writing
    (``CopyRefresh._write_keys``), then with this checkout's, alternated round after round; each
    round times ``--steps`` steps in full and ``--steps`` with the multi-tensor kernels skipped
    (the host's own work, as ``optimizer_host_ms``). Medians a tenant; the ways take turns going
    first."""
    then_steps = module_of(args.steps_from, "tinsmith/worker/joint_steps.py", into)
    then_refresh = module_of(args.steps_from, "tinsmith/models/copy_refresh.py", into)
    ways = {args.steps_from: (then_steps.step_together, then_refresh.CopyRefresh._write_keys),
            "this checkout": (runtime_module.step_together, copy_refresh.CopyRefresh._write_keys)}
    rank = 32 if args.widths > 16 else 8
    for n in (int(t) for t in args.tenants.split(",")):
        units = [rt.create_adapter(LoraSpec(rank=rank, seed=i)) for i in range(n)]
        requests = [TrainRequest(u, ForwardBackwardInput(batch(rt.config.vocab_size, max(1, 8 // n), 16, seed=i),
                                                         "cross_entropy")) for i, u in enumerate(units)]
        times: dict[str, dict[str, list[float]]] = {way: {"full": [], "host": []} for way in ways}
        try:
            for _ in range(2):  # warm: layouts, stacks, optimizer state
                rt.forward_backward(requests)
                optimizer_steps(rt, units, True)
            for r in range(args.rounds):
                # ABBA: each way goes first in every other round (the first of a round ran slower
                # than the second on this CPU, whatever the code: two ways of one commit differ so)
                for way, (together, write_keys) in list(ways.items())[::-1 if r % 2 else 1]:
                    runtime_module.step_together, copy_refresh.CopyRefresh._write_keys = together, write_keys
                    for how in ("full", "host"):
                        for _ in range(args.steps):
                            rt.forward_backward(requests)
                            with optimizer_kernels_skipped() if how == "host" else contextlib.nullcontext():
                                t0 = time.perf_counter()
                                optimizer_steps(rt, units, True)
                                times[way][how].append(1e3 * (time.perf_counter() - t0) / n)
        finally:
            runtime_module.step_together, copy_refresh.CopyRefresh._write_keys = ways["this checkout"]
            for u in units:
                rt.delete_adapter(u)
        results[n] = {way: {f"{how}_ms_a_tenant": statistics.median(ms) for how, ms in t.items()}
                      for way, t in times.items()}
        for way, r in results[n].items():
            print(f"{n:>3} tenants, joint steps of {way:>13}: {r['full_ms_a_tenant']:6.3f} ms a tenant, host alone "
                  f"{r['host_ms_a_tenant']:6.3f} ({args.rounds} rounds of {args.steps} steps each)", flush=True)


def compare_single_steps(rt: TrainingRuntime, args, results: dict) -> None:
    """``--single-steps``: one tenant's optimizer step by torch's optimizer (``Trainable.step``) and
    by the runtime's ``optim_step``, ``--rounds`` rounds of ``--steps`` steps each way, in full and
    with the kernels skipped (the host's own work), alternated (ABBA); medians in ms."""
    from tinsmith.types import AdamParams

    unit = rt.create_adapter(LoraSpec(rank=32 if args.widths > 16 else 8, seed=0))
    requests = [TrainRequest(unit, ForwardBackwardInput(batch(rt.config.vocab_size, 8, 16, seed=0), "cross_entropy"))]
    hp = AdamParams(learning_rate=1e-5)
    ways = {"torch's optimizer": lambda: rt.unit(unit).step(hp), "runtime's optim_step": lambda: rt.optim_step(unit, hp)}
    times: dict[str, dict[str, list[float]]] = {way: {"full": [], "host": []} for way in ways}
    try:
        for _ in range(2):  # warm: layouts, optimizer state
            rt.forward_backward(requests)
            rt.optim_step(unit, hp)
        for r in range(args.rounds):
            for way, step in list(ways.items())[::-1 if r % 2 else 1]:
                for how in ("full", "host"):
                    for _ in range(args.steps):
                        rt.forward_backward(requests)
                        with optimizer_kernels_skipped() if how == "host" else contextlib.nullcontext():
                            t0 = time.perf_counter()
                            step()
                            times[way][how].append(1e3 * (time.perf_counter() - t0))
    finally:
        rt.delete_adapter(unit)
    for way, t in times.items():
        results[way] = {f"{how}_ms": statistics.median(ms) for how, ms in t.items()}
        print(f"one tenant's step by {way:>20}: {results[way]['full_ms']:6.3f} ms, host alone "
              f"{results[way]['host_ms']:6.3f} ({args.rounds} rounds of {args.steps} steps each)", flush=True)


def compare_nodes(rt: TrainingRuntime, args, then, results: dict) -> None:
    """``--nodes-from``: each tenant count's forward/backward less its grouped matmuls, medians over
    ``--rounds`` rounds of ``--steps`` steps with the layers on ``REV``'s nodes, then on this
    checkout's, alternated."""
    ways = {args.nodes_from: (then.tenants_linear, then.tenants_group),
            "this checkout": (lora_tenants.tenants_linear, lora_tenants.tenants_group)}
    rank = 32 if args.widths > 16 else 8
    for n in (int(t) for t in args.tenants.split(",")):
        units = [rt.create_adapter(LoraSpec(rank=rank, seed=i)) for i in range(n)]
        per = max(1, 8 // n)
        requests = [TrainRequest(u, ForwardBackwardInput(batch(rt.config.vocab_size, per, 16, seed=i), "cross_entropy"))
                    for i, u in enumerate(units)]
        times: dict[str, list[float]] = {way: [] for way in ways}
        try:
            for _ in range(args.rounds):
                for way, (linear, group) in ways.items():
                    lora.tenants_linear, lora.tenants_group = linear, group
                    for step in range(args.steps + 1):  # the first step of a round re-stacks the adapters
                        with grouped_mm_timer() as in_grouped:
                            t0 = time.perf_counter()
                            rt.forward_backward(requests)
                            t = time.perf_counter() - t0
                        optimizer_steps(rt, units, True)
                        if step:
                            times[way].append(1e3 * (t - in_grouped[0]))
        finally:
            lora.tenants_linear, lora.tenants_group = ways["this checkout"]
            for u in units:
                rt.delete_adapter(u)
        results[n] = {}
        for way, ms in times.items():
            q = statistics.quantiles(ms, n=4) if len(ms) > 1 else ms * 3
            results[n][way] = {"median_ms": statistics.median(ms), "quartiles_ms": [q[0], q[2]], "steps": len(ms)}
            print(f"{n:>3} tenants, nodes of {way:>13}: forward/backward less its grouped matmuls, median "
                  f"{statistics.median(ms):6.1f} ms (quartiles {q[0]:.1f}-{q[2]:.1f}, {len(ms)} steps)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", help="tenant counts (default 1,4,16; with --nodes-from, 4,16: one tenant "
                                      "does not run these nodes)")
    ap.add_argument("--steps", type=int, help="steps timed (default 10; with --nodes-from, 4 a round)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--widths", type=int, choices=(16, 64), default=64, help="hidden size (rank 8 at 16, else 32)")
    ap.add_argument("--nodes-from", metavar="REV", help="compare the several-tenant nodes of commit REV with this "
                                                        "checkout's, in one process")
    ap.add_argument("--steps-from", metavar="REV", help="compare the joint optimizer steps (their step_together and "
                                                        "key writing) of commit REV with this checkout's, in one process")
    ap.add_argument("--single-steps", action="store_true", help="compare one tenant's step by torch's optimizer "
                                                                  "with the runtime's optim_step, in one process")
    ap.add_argument("--rounds", type=int, default=6, help="with --nodes-from, --steps-from or --single-steps: rounds "
                                                          "of each, alternated")
    ap.add_argument("--json")
    args = ap.parse_args()
    if sum(map(bool, (args.nodes_from, args.steps_from, args.single_steps))) > 1:
        ap.error("--nodes-from, --steps-from and --single-steps compare one thing each: give one")
    args.steps = args.steps or (4 if args.nodes_from or args.steps_from or args.single_steps else 10)
    args.tenants = args.tenants or ("4,16" if args.nodes_from or args.steps_from else "1,4,16")
    torch.set_num_threads(1)
    moe.GROUPED_MM = "grouped"  # the grouped matmul runs here as on a GPU
    grouped_lora.MULTI_LORA = "grouped"
    families.fused_adamw_fits = lambda params: True  # torch's fused AdamW, as on a GPU (it runs on CPUs too)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        w = args.widths
        shape = TinyShape(num_hidden_layers=args.layers, hidden_size=w, intermediate_size=2 * w, head_dim=16 if w > 16 else 8,
                          num_attention_heads=4 if w > 16 else 2, num_key_value_heads=2 if w > 16 else 1)
        make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        rt = TrainingRuntime(load_model(str(Path(d) / "m"), dtype=dtype).model, max_lora_adapters=16,
                             max_lora_rank=32)
        results = {}
        with tuned_for_serving():  # the collector as the server sets it (its pauses are not the steps')
            if args.nodes_from:
                compare_nodes(rt, args, nodes_of(args.nodes_from, Path(d)), results)
            elif args.steps_from:
                compare_steps(rt, args, Path(d), results)
            elif args.single_steps:
                compare_single_steps(rt, args, results)
            else:
                measure(rt, args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "layers": args.layers, "dtype": args.dtype,
                                               "widths": args.widths,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
