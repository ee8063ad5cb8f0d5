"""Run each base model's sampling and training paths once at start-up, before the server says
it is ready.

The first call of a fresh process pays one-time costs: CUDA context and library handles (cuBLAS,
the caching allocator's first blocks), kernel selection, and lazily built dispatch tables. Users
meet that cost on their first ``sample`` (measured 27-33 s on an H100 for a 1.7B model before
this existed and cuDNN attention was turned off, 6.4 s steady). Paying it here makes the first
request as fast as the later ones; the log line says what it cost.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tinsmith import device_memory
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams

log = logging.getLogger(__name__)

PROMPT_TOKENS, NEW_TOKENS = 24, 8


def configure_device(device: torch.device, dependent_launches: bool = True, memory_fraction: float = 1.0) -> None:
    """Process-wide switches for ``device``. On CUDA, cuDNN's attention is turned off: it builds an
    execution plan for every new (batch, length) shape, and decoding meets a new length at every
    step (measured: a first sample call of 27-33 s became 5 s, and steady decoding got a little
    faster, 4.2k vs 3.8k tokens/s); the flash and memory-efficient kernels serve instead. Whether
    the Triton kernels launch dependent on the kernel before (:mod:`tinsmith.kernels.pdl`;
    ``dependent_launches`` False: never, in this process) is probed here, before any request,
    rather than at the first kernel a request launches. The allocator is capped at
    ``memory_fraction`` of the device (:mod:`tinsmith.device_memory`) before anything sizes
    itself from the free memory."""
    from tinsmith.kernels import pdl  # late: Triton's import is heavy

    pdl.ENABLED = "auto" if dependent_launches else "off"
    device_memory.limit(device, memory_fraction)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        pdl.active(torch.empty(1, device=device))


def warm_up(worker, base) -> float:
    """Sample (top-p with logprobs, plain temperature, greedy) and run a forward/backward on
    ``base`` (one of ``worker``'s base models) with a throwaway adapter; returns the seconds it
    took. Leaves no state behind: the sampler's requests finish and the adapter is deleted."""
    started = time.perf_counter()
    cfg = base.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(cfg.vocab_size, 1000), PROMPT_TOKENS)
    from tinsmith.sampling.sampler import SampleTask  # late: keeps start-up imports light

    sampler = worker.sampler(base)
    # Replicas (--data-parallel-size) each warm up: one request each, with prompts of their own
    # (a request goes to the least busy replica unless its prompt follows an earlier one).
    replicas = getattr(sampler, "replicas", 1)
    prompts = [prompt] + [rng.integers(0, min(cfg.vocab_size, 1000), PROMPT_TOKENS) for _ in range(replicas - 1)]
    # Truncated sampling with logprobs, then plain temperature, then greedy rows: each way of
    # choosing tokens runs (on a GPU the last two are kernels built on first use).
    for round_, (temperature, top_p) in enumerate(((1.0, 0.95), (1.0, 1.0), (0.0, 1.0))):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, seed=0, stop=[])
        _sample_round(sampler, [SampleTask(f"warm-up-{round_}-{r}", None, SampleInput(
            prompt=p, num_samples=2, prompt_logprobs=round_ == 0, params=params)) for r, p in enumerate(prompts)])
    _warm_training(base.lora, prompt, replicas)
    if base.lora.device.type == "cuda":
        torch.cuda.synchronize(base.lora.device)
    return time.perf_counter() - started


def _sample_round(sampler, tasks: list) -> None:
    """Queue ``tasks`` and step the sampler until each finished (raising the first failure)."""
    keys = {t.key for t in tasks}
    for t in tasks:
        sampler.add(t)
    while keys:
        for key, result in sampler.step(budget_s=1.0):
            if key in keys:
                if isinstance(result, Exception):
                    raise result
                keys.discard(key)


def _warm_training(rt, tokens: np.ndarray, replicas: int = 1) -> None:
    """forward_backward and optim_step (learning rate 0) on a throwaway rank-1 adapter; one datum
    per replica, so each runs one."""
    from tinsmith.worker.runtime import TrainRequest

    datum = Datum(tokens=tokens[:-1], loss_inputs={"target_tokens": tokens[1:],
                                                   "weights": np.ones(len(tokens) - 1, np.float32)})
    unit = rt.create_adapter(LoraSpec(rank=1, seed=0))
    try:
        (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput([datum] * replicas, "cross_entropy"))])
        if isinstance(res, Exception):
            raise res
        rt.optim_step(unit, AdamParams(learning_rate=0.0))
    finally:
        rt.delete_adapter(unit)
