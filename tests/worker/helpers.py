"""Helpers for runtime tests: random datums and a peft reference model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from tinsmith.devtools.peft_twin import peft_twin, twin_name
from tinsmith.types import Datum


def sft_datum(rng: np.random.Generator, n: int, vocab: int, signed: bool = False) -> Datum:
    t = rng.integers(0, vocab, n + 1)
    w = rng.normal(size=n).astype(np.float32) if signed else (rng.random(n) > 0.3).astype(np.float32)
    return Datum(tokens=t[:-1], loss_inputs={"target_tokens": t[1:], "weights": w})


def peft_reference(model_dir, rt, unit: int):
    """A transformers+peft model carrying the same LoRA weights as ``rt``'s adapter ``unit``."""
    tr = rt.unit(unit)
    ours = dict(tr.named_params)
    return peft_twin(model_dir, tr.spec, ours), ours


def peft_grads(ref) -> dict[str, torch.Tensor]:
    return {twin_name(n): p.grad for n, p in ref.named_parameters() if p.grad is not None}


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float, name: str = "") -> None:
    """Whole-tensor relative error ||a-b|| / ||b|| below ``tol`` (robust to summation order)."""
    denom = float(b.norm()) or 1.0
    rel = float((a - b).norm()) / denom
    assert rel < tol, f"{name}: relative error {rel:.2e} >= {tol:.0e}"


def dispatched(fn) -> Counter:
    """The operators ``fn()`` dispatches, counted by name (each one that computes is a kernel
    launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        fn()
    return ops
