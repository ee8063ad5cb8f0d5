"""Helpers of the sampler tests: fresh tiny models, running a sampler to completion, references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime
from tinsmith.worker.trainables import install_lora_weights


def decoder(model_dir: Path):
    """token ids -> text with the checkpoint's own tokenizer (special tokens kept)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def fresh_model(model_dir: Path) -> CausalLM:
    """A new instance per test, so adapters installed by one test never leak into another."""
    return load_model(str(model_dir)).model


def make_sampler(model: CausalLM, model_dir: Path, **kw) -> Sampler:
    return Sampler(model, decoder(model_dir), **kw)


def task(key, prompt, *, slot=None, n=1, **params) -> SampleTask:
    """A SampleTask; keyword arguments that are SampleInput fields go there, the rest to SamplingParams."""
    input_fields = {"prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_logprobs_last_n"}
    extra = {k: params.pop(k) for k in list(params) if k in input_fields}
    inp = SampleInput(np.asarray(prompt, dtype=np.int64), n, SamplingParams(**params), **extra)
    return SampleTask(key, slot, inp)


def mixed_tasks(vocab: int, seed: int, stop_share: int, late: bool = False) -> list[SampleTask]:
    """Requests whose rows end in every way a burst of decode steps meets: stop tokens (a
    ``1/stop_share`` of the vocabulary), max_tokens, seeds, greedy rows, top-p / top-k, two
    adapters (slots 1, 2), top-k sample logprobs; ``late``: two more, one on an adapter."""
    rng = np.random.default_rng(seed)
    stops = sorted(rng.choice(np.arange(4, vocab), size=vocab // stop_share, replace=False).tolist())
    prompts = [rng.integers(4, vocab, n).tolist() for n in (5, 11, 8, 3, 14, 6, 9)]
    tasks = [
        task("stop-tokens", prompts[0], n=3, max_tokens=40, temperature=1.0, seed=1, stop=stops),
        task("greedy-stops", prompts[1], max_tokens=33, temperature=0.0, stop=stops[::2]),
        task("adapter-a", prompts[2], slot=1, n=2, max_tokens=17, temperature=0.8, top_p=0.9, seed=3, stop=stops,
             topk_sample_logprobs=3),
        task("adapter-b", prompts[3], slot=2, max_tokens=9, temperature=1.0, top_k=20, seed=4, stop=[]),
        task("long", prompts[4], max_tokens=50, temperature=1.0, seed=5, stop=[], topk_sample_logprobs=2),
    ]
    if late:
        tasks += [task("late", prompts[5], slot=1, max_tokens=21, temperature=0.0, stop=[]),
                  task("late-seeded", prompts[6], n=2, max_tokens=26, temperature=0.7, top_k=5, seed=6, stop=stops)]
    return tasks


def run(sampler: Sampler, tasks, *, budget_s: float = 0.05, max_steps: int = 10_000) -> dict:
    """Queue ``tasks``, step until every one is done; key -> SampleResult or error."""
    for t in tasks:
        sampler.add(t)
    out: dict = {}
    for _ in range(max_steps):
        if not sampler.has_work():
            break
        for key, res in sampler.step(budget_s):
            assert key not in out, f"task {key!r} finished twice"
            out[key] = res
    else:
        raise AssertionError(f"sampler still has work after {max_steps} steps")
    missing = {t.key for t in tasks} - set(out)
    assert not missing, f"tasks never finished: {missing}"
    return out


def scheduler_steps(sampler, n: int) -> dict:
    """One :meth:`Sampler.step` that runs exactly ``n`` scheduler steps (a count in place of its
    time budget, so the test observes steps, not timing); key -> result of what finished."""
    left = [n]

    def go_on(deadline, done) -> bool:
        left[0] -= 1
        return left[0] >= 0

    sampler._go_on = go_on
    try:
        return dict(sampler.step(60.0))
    finally:
        del sampler._go_on


def sample_one(sampler: Sampler, prompt, **kw):
    (res,) = run(sampler, [task("only", prompt, **kw)]).values()
    if isinstance(res, Exception):
        raise res
    return res


def forward_logprobs(model: CausalLM, tokens, slot: int | None = None) -> torch.Tensor:
    """log-softmax of one full forward pass (no cache): row i predicts token i + 1. (L, V) fp32."""
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
    L = t.shape[1]
    segs = None if slot is None else [(slot, 0, L)]
    with torch.inference_mode():
        h = model.hidden_states(t, torch.arange(L)[None], segs)
        return torch.log_softmax(model.logits(h[0], segs), dim=-1)


def random_adapter(model: CausalLM, slot: int, *, rank: int = 4, seed: int = 0, scale: float = 0.1) -> None:
    """Install an adapter with random (non-zero) A and B into ``slot`` (dense and expert layers),
    as sampler snapshots are."""
    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed):
        a_shape, b_shape = layer.lora_shapes(rank)
        tensors[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=g) * scale
        tensors[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=g) * scale
    install_lora_weights(model, slot, spec, tensors)


def training_adapters(model: CausalLM, g: torch.Generator | None = None) -> tuple[TrainingRuntime, int, int]:
    """A training runtime on ``model`` with two adapters made the way training runs make them, their
    B moved off zero (drawn from ``g``, by default seeded 7): one on every target (rank 8) and one
    on the MLPs only (rank 4)."""
    rt = TrainingRuntime(model, max_lora_adapters=4, max_lora_rank=16)
    unit = rt.create_adapter(LoraSpec(rank=8, alpha=16, seed=3))
    # One that targets only the MLPs: attention layers and the LM head have no weights for it.
    mlp_only = rt.create_adapter(LoraSpec(rank=4, alpha=8, seed=4, train_attn=False, train_unembed=False))
    g = torch.Generator().manual_seed(7) if g is None else g
    with torch.no_grad():
        for u in (unit, mlp_only):
            for name, p in rt.unit(u).named_params:
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return rt, unit, mlp_only


@pytest.fixture
def qwen3_model(qwen3_dir) -> CausalLM:
    return fresh_model(qwen3_dir)


@pytest.fixture
def sampler(qwen3_model, qwen3_dir) -> Sampler:
    return make_sampler(qwen3_model, qwen3_dir)


@pytest.fixture(autouse=True)
def _single_intra_op_thread():
    """The models here are tiny; with other processes on the CPU, OpenMP's spinning worker
    threads would make every step many times slower without making anything more exact."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def three_rows_in_a_bucket_of_four(model_dir: Path, **sampler_kwargs) -> Sampler:
    """A fresh model's sampler taking the static step (uncaptured), with 3 rows admitted: a
    bucket of 4, so one padding row. What the padding-row tests start from."""
    from tinsmith.sampling.decode_graphs import DecodeGraphs

    model = fresh_model(model_dir)
    sampler = Sampler(model, decoder(model_dir), decode_burst=2, **sampler_kwargs)
    sampler.graphs = DecodeGraphs(model, sampler.cache, capture=False, stats=sampler.stats)
    sampler.add(task("three", [5, 6, 7, 8], n=3, max_tokens=20, temperature=1.0, seed=1, stop=[]))
    with torch.inference_mode():
        sampler._admit([])
    return sampler
