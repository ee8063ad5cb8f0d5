"""Micro-benchmark: the gated delta rule of Qwen3.5's linear layers, forward + backward.

Three implementations of the same rule, side by side in one process:

* ``chunked``: :func:`tinsmith.models.gated_deltanet.chunk_gated_delta_rule` (training, prefill);
* ``reference``: transformers' ``torch_chunk_gated_delta_rule`` (the same algorithm; the ratio
  shows what our version costs or saves);
* ``recurrent``: one :func:`recurrent_gated_delta_step` per token (what decode runs), to show
  why whole sequences are chunked.

    python bench/deltanet_micro.py [--device cpu|cuda] [--shape 1x1024x16x32x128] [--repeats 5]

Shape is ``batch x tokens x key_heads x value_heads x head_dim`` (Qwen3.5's text default is
16 key / 32 value heads of 128). Reports the median seconds of one forward + backward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.models.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_step  # noqa: E402


def _recurrent(q, k, v, g, beta):
    state = q.new_zeros(q.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        o, state = recurrent_gated_delta_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                              beta[:, t:t + 1], state)
        outs.append(o)
    return torch.cat(outs, 1), state


def _reference(q, k, v, g, beta):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    fn = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    return fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, output_final_state=True)


def _time(fn, inputs, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        for t in inputs:
            t.grad = None
        start = time.perf_counter()
        out, _ = fn(*inputs)
        out.float().square().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="1x1024x16x32x128")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-recurrent", action="store_true")
    a = p.parse_args()
    device = torch.device(a.device)
    b, L, hk, hv, d = (int(x) for x in a.shape.split("x"))
    g = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device).requires_grad_()

    inputs = [leaf(b, L, hk, d), leaf(b, L, hk, d), leaf(b, L, hv, d),
              (-torch.rand(b, L, hv, generator=g)).to(device).requires_grad_(),
              torch.rand(b, L, hv, generator=g).to(device).requires_grad_()]
    results = {"chunked": _time(chunk_gated_delta_rule, inputs, device, a.repeats),
               "reference": _time(_reference, inputs, device, a.repeats)}
    if not a.skip_recurrent:
        results["recurrent"] = _time(_recurrent, inputs, device, max(1, a.repeats // 2))
    print(f"device={device.type} shape={a.shape} threads={torch.get_num_threads()}")
    for name, t in results.items():
        print(f"{name:10s} {t * 1e3:9.1f} ms  ({t / results['chunked']:.2f} x chunked)")


if __name__ == "__main__":
    main()
