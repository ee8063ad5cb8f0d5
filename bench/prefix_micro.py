"""Micro-benchmark: prefix caching in the sampler, in-process, cache off and on side by side.

Workloads (the same requests for every configuration, all in one process; each configuration's
best of ``--repeats`` interleaved runs):

* ``grpo``: ``--prompts`` prompts x ``--samples`` samples of ``--max-tokens`` tokens, sent as
  one request per prompt with ``num_samples`` (the prompt is prefilled once either way), and as
  separate single-sample requests (how RL programs send GRPO groups; without the cache each
  request prefills its prompt again). Same sampled tokens in every variant.
* ``shared_system``: ``2 * --prompts`` different prompts behind one system prompt (the first
  ``--prompt-length`` minus ``--question-tokens`` tokens), ``--samples`` samples each, sent in two
  waves (as when a batch of GRPO groups does not fit the sampler at once): the second wave's
  prompts share only the system prompt with the first's. Dense models reuse its blocks; hybrid
  models prefill it once and continue each prompt from it.
* ``multi_turn``: ``--prompts`` conversations, ``--turns`` turns each: every turn's prompt is
  the previous prompt, its sampled reply and ``--turn-tokens`` new user tokens, so without the
  cache each turn prefills the whole conversation again.

Each runs over every K/V layout of ``--kv-layouts`` (``rows``: per-row buffers, the prefix
cache's blocks copied into them on a hit; ``paged``: the blocks are pages of the K/V pool, held
in place by a hit; ``auto``: the device's default).

Reported: wall seconds, sampled tokens/s, and prompt tokens prefilled (computed) vs taken
from the cache or shared. The model is made on the spot (``--shape``, ``--family``): prefill is
a larger share of the work the longer the prompts and the larger the model. With ``--family
qwen3_5`` (a hybrid: no block cache) "on" is the kept whole prompts: a prompt sent again, and a
turn continuing from the turn before it.

    python bench/prefix_micro.py [--shape small] [--family qwen3] [--prompt-length 512] [--kv-layouts rows,paged]
                                 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.sampling.sampler import Sampler, SampleTask  # noqa: E402
from tinsmith.types import SampleInput, SamplingParams  # noqa: E402

SHAPES = {
    "tiny": TinyShape(),  # ~4.2M parameters
    "small": TinyShape(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def run_all(sampler: Sampler, tasks: list[SampleTask]) -> dict:
    for t in tasks:
        sampler.add(t)
    out = {}
    while sampler.has_work():
        for key, res in sampler.step(1.0):
            if isinstance(res, Exception):
                raise res
            out[key] = res
    return out


def grpo(sampler: Sampler, prompts: list[np.ndarray], samples: int, max_tokens: int, separate: bool) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=7)
    if separate:
        tasks = [SampleTask((i, j), None, SampleInput(p, 1, params)) for i, p in enumerate(prompts)
                 for j in range(samples)]
    else:
        tasks = [SampleTask(i, None, SampleInput(p, samples, params)) for i, p in enumerate(prompts)]
    return run_all(sampler, tasks)


def shared_system(sampler: Sampler, system: np.ndarray, questions: list[np.ndarray], samples: int,
                  max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=7)
    tasks = [SampleTask(i, None, SampleInput(np.concatenate([system, q]), samples, params))
             for i, q in enumerate(questions)]
    half = len(tasks) // 2
    return {**run_all(sampler, tasks[:half]), **run_all(sampler, tasks[half:])}


def multi_turn(sampler: Sampler, prompts: list[np.ndarray], turns: int, turn_tokens: int, max_tokens: int,
               rng: np.random.Generator) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=7)
    convs = [list(p) for p in prompts]
    out = {}
    for t in range(turns):
        res = run_all(sampler, [SampleTask((i, t), None, SampleInput(np.asarray(c), 1, params))
                                for i, c in enumerate(convs)])
        out.update(res)
        for i, c in enumerate(convs):
            reply = res[(i, t)].sequences[0].tokens.tolist()
            c += reply + rng.integers(4, sampler.cfg.vocab_size, turn_tokens).tolist()
    return out


def measure_once(model, workload, cache_bytes: int, kv_layout: str = "auto") -> dict:
    """One run of ``workload(sampler)`` on a fresh sampler (an empty prefix cache)."""
    sampler = Sampler(model, lambda toks: "", prefix_cache_bytes=cache_bytes, kv_layout=kv_layout)
    t = time.perf_counter()
    res = workload(sampler)
    wall = time.perf_counter() - t
    sampled = sum(len(s.tokens) for r in res.values() for s in r.sequences)
    return {"wall_s": round(wall, 3), "sampled_tokens_per_s": round(sampled / wall, 1),
            "prompt_tokens_computed": sampler.stats["prefill_tokens"],
            "prompt_tokens_cached": sampler.stats["cached_prompt_tokens"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--family", choices=("qwen3", "qwen3_5"), default="qwen3")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--workloads", default="grpo num_samples,grpo separate,shared_system,multi_turn",
                   help="comma-separated workloads to run")
    p.add_argument("--cache-bytes", type=int, default=1 << 30)
    p.add_argument("--kv-layouts", default="auto", help="comma-separated K/V layouts to run: auto, rows, paged")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default: torch's own; 1 suffers least from busy neighbours)")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory()
    model = load_model(str(make_tiny_model(Path(tmp.name) / "model", a.family, shape=SHAPES[a.shape]))).model
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(4, vocab, a.prompt_length) for _ in range(a.prompts)]
    system = rng.integers(4, vocab, a.prompt_length - a.question_tokens)
    questions = [rng.integers(4, vocab, a.question_tokens) for _ in range(2 * a.prompts)]
    out: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
                 "shape": a.shape, "family": a.family, "params": sum(p.numel() for p in model.parameters()), "args": vars(a), "runs": {}}
    cases: dict = {
        "grpo num_samples": lambda s: grpo(s, prompts, a.samples, a.max_tokens, separate=False),
        "grpo separate": lambda s: grpo(s, prompts, a.samples, a.max_tokens, separate=True),
        "shared_system": lambda s: shared_system(s, system, questions, a.samples, a.max_tokens),
        "multi_turn": lambda s: multi_turn(s, prompts, a.turns, a.turn_tokens, a.max_tokens,
                                           np.random.default_rng(1)),
    }
    cases = {name: cases[name] for name in a.workloads.split(",")}
    measure_once(model, next(iter(cases.values())), 0)  # warm-up: first-call costs land in no figure
    layouts = a.kv_layouts.split(",")
    configs = [(name, layout, label, nbytes) for name in cases for layout in layouts
               for label, nbytes in (("off", 0), ("on", a.cache_bytes))]
    best: dict = {}
    for _ in range(a.repeats):  # interleaved, so a busy spell on the machine hits every configuration alike
        for name, layout, label, nbytes in configs:
            r = measure_once(model, cases[name], nbytes, layout)
            key = f"{name} / {layout} / cache {label}"
            if key not in best or r["wall_s"] < best[key]["wall_s"]:
                best[key] = r
    print(f"{'workload':<18} {'layout':>6} {'cache':>6} {'wall s':>8} {'tok/s':>8} {'computed':>9} {'cached':>8}")
    for name, layout, label, _ in configs:
        key = f"{name} / {layout} / cache {label}"
        r = out["runs"][key] = best[key]
        print(f"{name:<18} {layout:>6} {label:>6} {r['wall_s']:>8.2f} {r['sampled_tokens_per_s']:>8.0f} "
              f"{r['prompt_tokens_computed']:>9} {r['prompt_tokens_cached']:>8}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
