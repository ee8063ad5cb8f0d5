"""Benchmark workloads driven through the tinker SDK; prints one JSON object.

Runs under any SDK from 0.22.2 on (only numpy besides ``tinker``), so the same code measures
tinsmith (newest SDK) and the peer (which needs 0.22.2):

    python bench/workloads.py --base-url URL --model NAME --workload sft --batch 8 --length 128
    workloads: sft, sample, sample_concurrent, multitenant, latency, rl_step
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

import numpy as np
import tinker
from tinker import types


def _datum(rng: np.random.Generator, n: int, vocab: int) -> types.Datum:
    t = rng.integers(1, vocab, n + 1).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * n},
    )


def _client(a) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=a.base_url, api_key="tml-bench")


def _trainer(sc, a, seed: int = 0):
    tc = sc.create_lora_training_client(base_model=a.model, rank=a.rank, seed=seed)
    return tc.result() if hasattr(tc, "result") else tc  # newer SDKs return a future of the client


def sft(a) -> dict:
    """Pipelined SFT steps (forward_backward and optim_step submitted before waiting)."""
    sc = _client(a)
    tc = _trainer(sc, a)
    rng = np.random.default_rng(0)
    data = [_datum(rng, a.length, a.vocab) for _ in range(a.batch)]
    adam = types.AdamParams(learning_rate=1e-4)
    t0 = time.perf_counter()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    first = time.perf_counter() - t0
    for _ in range(a.warmup):
        fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
        fb.result(), op.result()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
        fb.result(), op.result()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"tokens_per_s": a.batch * a.length / med, "median_step_s": med, "first_step_s": first}


def multitenant(a) -> dict:
    """``--tenants`` training clients, each running SFT steps at once; aggregate tokens/s."""
    sc = _client(a)
    tcs = [_trainer(sc, a, seed=i) for i in range(a.tenants)]
    rng = np.random.default_rng(1)
    datas = [[_datum(rng, a.length, a.vocab) for _ in range(a.batch)] for _ in tcs]
    adam = types.AdamParams(learning_rate=1e-4)

    def run(i: int, steps: int, out: list) -> None:
        for _ in range(steps):
            fb, op = tcs[i].forward_backward(datas[i], "cross_entropy"), tcs[i].optim_step(adam)
            fb.result(), op.result()
        out.append(time.perf_counter())

    for i in range(len(tcs)):  # warm every adapter once
        run(i, 1, [])
    ends: list[float] = []
    threads = [threading.Thread(target=run, args=(i, a.steps, ends)) for i in range(len(tcs))]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = max(ends) - t0
    tokens = a.tenants * a.steps * a.batch * a.length
    return {"tenants": a.tenants, "tokens_per_s": tokens / wall, "wall_s": wall}


def _prompts(rng, n: int, length: int, vocab: int) -> list:
    return [types.ModelInput.from_ints(rng.integers(1, vocab, length).tolist()) for _ in range(n)]


def _sample_run(sampler, prompts, num_samples: int, max_tokens: int) -> tuple[int, float]:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])

    async def go():
        futs = [sampler.sample_async(p, num_samples, params) for p in prompts]
        return await asyncio.gather(*futs)

    t = time.perf_counter()
    res = asyncio.run(go())
    wall = time.perf_counter() - t
    return sum(len(s.tokens) for r in res for s in r.sequences), wall


def sample(a, concurrent: bool = False) -> dict:
    sc = _client(a)
    sampler = sc.create_sampling_client(base_model=a.model)
    rng = np.random.default_rng(2)
    n_prompts, n_samples = (a.concurrency, 1) if concurrent else (a.prompts, a.samples)
    prompts = _prompts(rng, n_prompts, a.prompt_length, a.vocab)
    _sample_run(sampler, prompts[:2], 1, 4)  # warm-up
    rates = []
    for _ in range(a.repeats):
        tokens, wall = _sample_run(sampler, prompts, n_samples, a.max_tokens)
        rates.append(tokens / wall)
    return {"tokens_per_s": statistics.median(rates), "requests": n_prompts, "num_samples": n_samples,
            "max_tokens": a.max_tokens}


def latency(a) -> dict:
    """Idle round trip of a one-datum forward (submit + result) through the SDK."""
    sc = _client(a)
    tc = _trainer(sc, a)
    rng = np.random.default_rng(3)
    d = [_datum(rng, 16, a.vocab)]
    fwd = getattr(tc, "forward")
    for _ in range(5):
        fwd(d, "cross_entropy").result()
    lat = []
    for _ in range(a.steps):
        t = time.perf_counter()
        fwd(d, "cross_entropy").result()
        lat.append(time.perf_counter() - t)
    lat.sort()
    return {"median_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))]}


def rl_step(a) -> dict:
    """One RL iteration: new sampler snapshot, G samples for P prompts, importance_sampling step."""
    sc = _client(a)
    tc = _trainer(sc, a)
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, a.prompts, a.prompt_length, a.vocab)
    params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0, stop=[])
    adam = types.AdamParams(learning_rate=1e-4)

    def iteration() -> float:
        t = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()

        async def go():
            return await asyncio.gather(*[sampler.sample_async(p, a.samples, params) for p in prompts])

        results = asyncio.run(go())
        data = []
        for p, r in zip(prompts, results):
            rewards = [float(np.mean(np.asarray(s.tokens) % 2 == 0)) for s in r.sequences]
            base = float(np.mean(rewards))
            for s, rew in zip(r.sequences, rewards):
                toks = p.to_ints() + list(s.tokens)
                P = p.length
                n = len(toks) - 1
                lp = [0.0] * (P - 1) + list(s.logprobs)
                adv = [0.0] * (P - 1) + [rew - base] * len(s.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "logprobs": lp[:n], "advantages": adv[:n]},
                ))
        fb, op = tc.forward_backward(data, "importance_sampling"), tc.optim_step(adam)
        fb.result(), op.result()
        return time.perf_counter() - t

    iteration()
    times = [iteration() for _ in range(a.repeats)]
    return {"median_step_s": statistics.median(times), "prompts": a.prompts, "samples": a.samples,
            "max_tokens": a.max_tokens}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True,
                   choices=["sft", "sample", "sample_concurrent", "multitenant", "latency", "rl_step"])
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    fn = {"sft": sft, "sample": sample, "sample_concurrent": lambda x: sample(x, True), "multitenant": multitenant,
          "latency": latency, "rl_step": rl_step}[a.workload]
    out = fn(a)
    out["sdk_version"] = getattr(tinker, "__version__", "?")
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
