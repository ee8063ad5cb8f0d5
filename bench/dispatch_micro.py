"""Micro-benchmark: the device operations one LoRA forward/backward dispatches, by tenant count.

On a GPU a training step of a small model is bound by the host as much as by the device: each
operation that runs a kernel costs the host a launch (an H100 profile of an early build spent
815 ms of CPU against 335 ms of GPU on a four-tenant step). A CPU cannot time that, but it can
count it: the same code dispatches the same operations. This counts the operations that run a
kernel (views, slices and transposes excluded) for one forward/backward of 1, 4 and 16 tenants
sharing one step, on a model with Qwen3-1.7B's 28 layers (tiny widths), LoRA rank 32 on every
linear layer, and the multi-tenant paths a GPU takes (the grouped matmul, forced here). Each
count is taken twice: on fresh gradients (after an optimizer step), and accumulating onto an
earlier call's (several calls before one step, as the cookbook's streaming mode sends them).

    python bench/dispatch_micro.py [--tenants 1,4,16] [--layers 28] [--multi-lora gpu|dense|grouped] [--json out.json]

It also reports the bytes one forward keeps for the backward, per token (each storage once).
``--training-kernels`` (with TRITON_INTERPRET=1) runs the norms, rotary and SiLU-and-multiply
through the training kernels a GPU takes (each Triton launch counted once), and ``--dtype
bf16`` holds the model in bf16, as on a GPU (where torch's norms keep an fp32 copy of their input).

``--decode ROWS`` counts one decode step instead: the static step a CUDA graph records (paged
K/V, a 128-token prompt, temperature 1, no adapter; ``--family llama``: a model without q/k norms), with the GPU's paths forced: every Triton
kernel (norms, SiLU-and-multiply, decode attention, the K/V stores, the token choice) runs in Triton's
interpreter and counts as one launch, and the torch operations around them count as on a GPU.

``--admission REQUESTS`` counts one admission of REQUESTS single-sample requests of a prompt an
earlier admission prefilled (GRPO's separate requests arriving while the first ones decode), on
the same paths, for a prompt of whole pages (128 tokens) and one 5 tokens longer. An admission
runs eagerly between graphed decode steps, so on a GPU each of its kernels is a launch the
decoding rows wait for.

``--prefill REQUESTS`` counts one admission of REQUESTS new 128-token prompts (nothing cached:
their prefill, as in a sampling benchmark's run; the norms and SiLU-and-multiply through torch,
whose kernels the interpreter would take minutes over), and ``--adapters N`` gives the rows of
that and of ``--decode`` N LoRA adapters (rank 32, every linear layer) in turn, as bench/gpu's
many-adapter decode does, with the several adapters' paths a GPU takes (the grouped matmul, forced
here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.train import optimizer_steps  # noqa: E402
from tinsmith.devtools.host_syncs import HostSyncs  # noqa: E402
from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.models import grouped_lora, lora_bank, moe  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.optim import families  # noqa: E402
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec  # noqa: E402
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest  # noqa: E402

# Operations that make no kernel: a view of existing memory, metadata, or reading a scalar (AdamW
# reads each parameter's step count, kept on the host; reads of device values are host waits,
# which tests/*/test_host_syncs.py hold to a budget).
_NO_KERNEL = ("view", "slice", ".t.", "transpose", "detach", "expand", "unsqueeze", "squeeze", "alias",
              "as_strided", "split", "permute", "select", "lift_fresh", "reshape", "unbind", "unflatten",
              "_local_scalar_dense",
              "profiler.")


class KernelOps(TorchDispatchMode):
    """Counts the dispatched operations that run a kernel, by name (not those a Triton kernel's
    interpreter makes: ``paused``)."""

    def __init__(self, no_kernel: tuple[str, ...] = _NO_KERNEL) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = 0
        self.no_kernel = no_kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.paused and not any(marker in name for marker in self.no_kernel):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def triton_launches_counted(counter: KernelOps):
    """Each Triton kernel run in the interpreter counts once in ``counter`` (``triton.<name>``), and
    the torch operations the interpreter makes meanwhile not at all."""
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        counter.paused += 1
        try:
            return real_run(self, *args, **kwargs)
        finally:
            counter.paused -= 1
            if not counter.paused:
                counter.ops[f"triton.{getattr(self.fn, '__name__', 'kernel')}"] += 1

    InterpretedFunction.run = launch
    try:
        yield counter
    finally:
        InterpretedFunction.run = real_run


def decode_step_kernels(model, rows: int, slots: list[int | None] = (None,), top: int = 20) -> dict:
    """The kernels of one static decode step of ``rows`` rows on the GPU's paths (see the module
    docstring), row ``i`` with adapter ``slots[i % len(slots)]``: total, Triton launches, and the
    most frequent operations."""
    from tinsmith.sampling.decode_graphs import DecodeGraphs, Variant, bucket_for
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    sampler = Sampler(model, lambda toks: "", max_rows=rows, kv_layout="paged", decode_burst=1)
    sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    rng = np.random.default_rng(0)
    for i in range(rows):
        sampler.add(SampleTask(i, slots[i % len(slots)], SampleInput(prompt=rng.integers(4, 500, 128), num_samples=1,
                                                    params=SamplingParams(max_tokens=8, temperature=1.0, stop=[]))))
    counter = KernelOps(_NO_KERNEL + ("aten.empty",))  # allocations launch nothing (a graph's come from its pool)
    with torch.inference_mode(), gpu_paths():
        done: list = []
        sampler._admit(done)
        sampler._decode_step(done)  # the bucket's buffers and the cache's pages
        bucket = bucket_for(rows)
        groups = sampler.graphs._groups  # the rows' bank positions, as the step before laid them out
        assert (groups is not None) == any(s is not None for s in slots)
        with triton_launches_counted(counter), counter:
            sampler.graphs._step(sampler.graphs._inputs[bucket], groups, Variant(bucket, groups is not None, False, False))
    ops = counter.ops
    launches = sum(v for k, v in ops.items() if k.startswith("triton."))
    return {"rows": rows, "kernels": sum(ops.values()), "triton_launches": launches, "top": dict(ops.most_common(top))}


@contextmanager
def gpu_paths():
    """Every Triton kernel a GPU's sampler runs, in the interpreter here (as it was after)."""
    from tinsmith.kernels import decode_attention, kv_store, lora_gather, rms_norm, step_rows, swiglu, token_draw
    from tinsmith.sampling import logits

    modules = (decode_attention, kv_store, lora_gather, rms_norm, step_rows, swiglu, token_draw)
    before = [m.BACKEND for m in modules], logits.BLOCKED_CDF
    for module in modules:
        module.BACKEND = "triton"
    logits.BLOCKED_CDF = "always"
    try:
        yield
    finally:
        for module, backend in zip(modules, before[0]):
            module.BACKEND = backend
        logits.BLOCKED_CDF = before[1]


def admission_kernels(model, requests: int, length: int, top: int = 12) -> dict:
    """The kernels of one admission of ``requests`` single-sample requests of a ``length``-token
    prompt that an earlier admission prefilled (see the module docstring)."""
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    warm = 2 * (requests + 1)
    sampler = Sampler(model, lambda toks: "", max_rows=warm, kv_layout="paged", decode_burst=1)
    rng = np.random.default_rng(1)
    prompt = rng.integers(4, 500, length)

    def add(key, tokens=prompt, new: int = 8) -> None:
        sampler.add(SampleTask(key, None, SampleInput(prompt=tokens, num_samples=1,
                                                      params=SamplingParams(max_tokens=new, temperature=1.0, stop=[]))))

    counter = KernelOps(_NO_KERNEL + ("aten.empty",))
    with torch.inference_mode():
        done: list = []
        other = rng.integers(4, 500, length)
        for i in range(warm):  # rows that end at once: the K/V pool grows past what the rows take, as in a busy server
            add(f"warm{i}", other, new=1)
        sampler._admit(done)
        assert len(done) == warm and not sampler.rows
        done.clear()
        add("first")
        sampler._admit(done)  # the prompt's prefill (through torch: not counted): its pages join the prefix cache
        for i in range(requests):
            add(i)
        prefills = sampler.stats["prefills"]
        with gpu_paths(), triton_launches_counted(counter), counter:
            sampler._admit(done)
    assert not done and len(sampler.rows) == requests + 1
    ops = counter.ops
    return {"requests": requests, "prompt_tokens": length, "kernels": sum(ops.values()),
            "forward_passes": sampler.stats["prefills"] - prefills, "top": dict(ops.most_common(top))}


def prefill_kernels(model, requests: int, slots: list[int | None], length: int = 128, top: int = 12) -> dict:
    """The kernels of one admission of ``requests`` new ``length``-token prompts, request ``i``
    with adapter ``slots[i % len(slots)]``: their prefill and first tokens (see the module docstring)."""
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.types import SampleInput, SamplingParams

    sampler = Sampler(model, lambda toks: "", max_rows=requests, kv_layout="paged", decode_burst=1)
    rng = np.random.default_rng(2)

    def admit(n: int) -> None:
        for i in range(n):
            sampler.add(SampleTask(i, slots[i % len(slots)], SampleInput(
                prompt=rng.integers(4, 500, length), num_samples=1,
                params=SamplingParams(max_tokens=1, temperature=1.0, stop=[]))))
        sampler._admit(done)

    counter = KernelOps(_NO_KERNEL + ("aten.empty",))
    done: list = []
    with torch.inference_mode():  # the norms through torch: the interpreter would take minutes a prefill
        admit(requests)  # the pools, the adapters' banks and stacks made: an earlier run's
        done.clear()
        with triton_launches_counted(counter), counter:
            admit(requests)
    ops = counter.ops
    return {"requests": requests, "prompt_tokens": length, "adapters": len([s for s in set(slots) if s is not None]),
            "kernels": sum(ops.values()), "top": dict(ops.most_common(top))}


def adapter_slots(model, adapters: int) -> list[int | None]:
    """``adapters`` LoRA adapters (rank 32, every linear layer) made on ``model``; [None] for none."""
    if not adapters:
        return [None]
    rt = TrainingRuntime(model, max_lora_adapters=adapters, max_lora_rank=32, max_training_runs=adapters)
    return [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(adapters)]


def saved_bytes_per_token(rt: TrainingRuntime, requests: list, tokens: int) -> float:
    """Bytes the forward keeps for the backward per token, the model's weights and buffers
    excepted (each storage once, views of it not again): what a micro-batch's activations cost."""
    held = {t.untyped_storage().data_ptr() for t in (*rt.model.parameters(), *rt.model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rt.forward_backward(requests)
    return sum(seen.values()) / tokens


def count(rt: TrainingRuntime, tenants: int, tokens: int = 1024, length: int = 128,
          interpreted: bool = False) -> dict:
    """The kernel-running operations of one forward/backward of ``tenants`` tenants (fresh and
    accumulating gradients) and of their optimizer steps, and the bytes kept for the backward per
    token; ``interpreted``: the training kernels run in Triton's interpreter, each counted once."""
    rng = np.random.default_rng(tenants)
    vocab = rt.config.vocab_size

    def datum() -> Datum:
        t = rng.integers(0, vocab, length + 1)
        return Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)})

    units = [rt.create_adapter(LoraSpec(rank=32, seed=i)) for i in range(tenants)]
    per = max(1, tokens // length // tenants)
    requests = [TrainRequest(u, ForwardBackwardInput([datum() for _ in range(per)], "cross_entropy")) for u in units]
    out = {}
    rt.forward_backward(requests)  # warm: layouts, caches
    for u in units:
        rt.optim_step(u, AdamParams())
    for case in ("fresh", "accumulating"):
        k = KernelOps()
        with (triton_launches_counted(k) if interpreted else nullcontext()), k:
            rt.forward_backward(requests)
        out[case] = {"kernel_ops": sum(k.ops.values()), "top": dict(k.ops.most_common(6))}
    out["saved_bytes_per_token"] = saved_bytes_per_token(rt, requests, per * length * tenants)
    for how in ("alone", "together"):  # one by one, then as the server takes steps that arrive together
        if how == "together":
            rt.forward_backward(requests)
        with KernelOps() as k, HostSyncs() as h:
            optimizer_steps(rt, units, together=how == "together")
        out[f"optimizer_steps_{how}"] = {"kernel_ops": sum(k.ops.values()), "host_syncs": h.count()}
    for u in units:
        rt.delete_adapter(u)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", default="1,4,16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step (in rows of 128), shared by the tenants")
    ap.add_argument("--multi-lora", choices=("gpu", "dense", "grouped"), default="gpu",
                    help="how several tenants' adapters run (gpu: the choice a Hopper GPU makes for the dtype and "
                         "tenant count)")
    ap.add_argument("--decode", type=int, metavar="ROWS", help="count one decode step of ROWS rows instead")
    ap.add_argument("--admission", type=int, metavar="REQUESTS",
                    help="count one admission of REQUESTS requests of an already prefilled prompt instead")
    ap.add_argument("--prefill", type=int, metavar="REQUESTS",
                    help="count one admission of REQUESTS new 128-token prompts (their prefill) instead")
    ap.add_argument("--adapters", type=int, default=0,
                    help="LoRA adapters the rows of --prefill and --decode take in turn (0: the base model)")
    ap.add_argument("--expands-apart", action="store_true",
                    help="--decode: every LoRA expand and shrink its own launch (none left to the kernels next to them)")
    ap.add_argument("--skinny-products", action="store_true",
                    help="--decode: the products through the skinny-product kernel (off by default on a GPU), "
                         "the adapters' shrinks in their launches")
    ap.add_argument("--training-kernels", action="store_true",
                    help="train through the norm/rotary/SiLU kernels (in Triton's interpreter)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's dtype for training counts")
    ap.add_argument("--widths", choices=("tiny", "1.7B"), default="tiny",
                    help="the layers' widths for training counts (1.7B: Qwen3-1.7B's, for the bytes kept per token)")
    ap.add_argument("--family", choices=("qwen3", "llama"), default="qwen3",
                    help="the model of --decode and --admission counts (llama: attention without q/k norms)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if (args.decode or args.admission or args.prefill or args.training_kernels) and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the Triton kernels run in the interpreter here: set TRITON_INTERPRET=1")
    if args.admission or args.decode or args.prefill:
        moe.GROUPED_MM = "grouped"  # several adapters' grouped matmuls run here as on a GPU
        if args.expands_apart:
            lora_bank.EXPANDS_TAKEN = lora_bank.SHRINKS_TAKEN = frozenset()
        if args.skinny_products:
            from tinsmith.kernels import skinny_matmul

            skinny_matmul.BACKEND = "triton"
        with tempfile.TemporaryDirectory() as d:
            shape = TinyShape(num_hidden_layers=args.layers, hidden_size=128, intermediate_size=256, head_dim=32)
            make_tiny_model(Path(d) / "m", args.family, shape, seed=0)
            model = load_model(str(Path(d) / "m")).model
            slots = adapter_slots(model, args.adapters)
            if args.prefill:
                r = prefill_kernels(model, args.prefill, slots)
                heads = [f"prefill of {r['requests']} new {r['prompt_tokens']}-token prompts, {r['adapters']} adapters, "
                         f"{args.layers} layers: {r['kernels']:,} kernels"]
                result = [r]
            elif args.admission:
                result = [admission_kernels(model, args.admission, length) for length in (128, 133)]
                heads = [f"admission of {r['requests']} requests of a prefilled {r['prompt_tokens']}-token prompt, "
                         f"{args.layers} layers: {r['kernels']:,} kernels, {r['forward_passes']} forward passes"
                         for r in result]
            else:
                r = decode_step_kernels(model, args.decode, slots)
                heads = [f"decode step, {r['rows']} rows, {len(set(slots) - {None})} adapters, {args.layers} layers: "
                         f"{r['kernels']:,} kernels "
                         f"({r['triton_launches']} Triton launches)"]
                result = [r]
        for head, r in zip(heads, result):
            print(head)
            for name, n in r["top"].items():
                print(f"  {n:>5}  {name}")
        if args.json:
            what = ({"admission": result} if args.admission else {"prefill": result[0]} if args.prefill
                    else {"decode": result[0]})
            Path(args.json).write_text(json.dumps({"torch": torch.__version__, "layers": args.layers, **what}, indent=2))
        return
    moe.GROUPED_MM = "grouped"  # the grouped matmul runs here as on a GPU
    families.fused_adamw_fits = lambda params: True  # torch's fused AdamW, as on a GPU (it runs on CPUs too)
    if args.training_kernels:
        from tinsmith.kernels import norm_grad, swiglu

        norm_grad.BACKEND = swiglu.BACKEND = "triton"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(num_hidden_layers=args.layers, hidden_size=128, intermediate_size=256, head_dim=32)
        if args.widths == "1.7B":
            shape = TinyShape(num_hidden_layers=args.layers, hidden_size=2048, intermediate_size=6144,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        make_tiny_model(Path(d) / "m", "qwen3", shape, seed=0)
        model = load_model(str(Path(d) / "m"), dtype=dtype).model
        rt = TrainingRuntime(model, max_lora_adapters=16, max_lora_rank=32)
        results = {}
        for n in (int(t) for t in args.tenants.split(",")):
            # gpu: what a Hopper GPU takes (grouped_lora.multi_lora_path): grouped matmuls in bf16;
            # dense stacked products for fp32 while the adapters' summed rank fits
            dense = (dtype == torch.float32 and n * 32 <= grouped_lora.DENSE_MAX_RANK if args.multi_lora == "gpu"
                     else args.multi_lora == "dense")
            grouped_lora.MULTI_LORA = "dense" if dense else "grouped"
            results[n] = r = count(rt, n, tokens=args.tokens, interpreted=args.training_kernels)
            r["multi_lora"] = grouped_lora.MULTI_LORA
            print(f"{n:>3} tenants{f' ({grouped_lora.MULTI_LORA})' if n > 1 else ''}: forward/backward "
                  f"{r['fresh']['kernel_ops']:>6,} kernel ops fresh, "
                  f"{r['accumulating']['kernel_ops']:>6,} accumulating; "
                  f"optimizer steps {r['optimizer_steps_alone']['kernel_ops']:>6,} one by one "
                  f"({r['optimizer_steps_alone']['host_syncs']} host syncs), {r['optimizer_steps_together']['kernel_ops']:>6,} "
                  f"together ({r['optimizer_steps_together']['host_syncs']}); "
                  f"kept for backward {r['saved_bytes_per_token']:,.0f} bytes a token")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"torch": torch.__version__, "layers": args.layers, "dtype": args.dtype,
             "training_kernels": args.training_kernels, "results": results}, indent=2))


if __name__ == "__main__":
    main()
