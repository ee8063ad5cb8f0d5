"""Every tensor the sampler and the training runtime make lands on the model's device.

On a machine without a GPU a tensor made on the CPU by mistake (``torch.full(n, x)`` without
``device=``) works silently; on CUDA it crashes the request. Here the model lives on the CPU
while the *default* device is ``meta``: any tensor made without naming its device lands on
``meta``, and the first op that mixes it with the model's tensors raises. So these tests fail
exactly where a CUDA run would, without a GPU.
"""

from __future__ import annotations

import contextlib
import numpy as np
import pytest
import torch

from tests.sampling.conftest import decoder, fresh_model, make_sampler, run, task
from tests.worker.helpers import sft_datum
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import AdamParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tinsmith.worker.trainables import install_lora_weights, lora_tensors


def _ok(results: dict) -> dict:
    for key, res in results.items():
        assert not isinstance(res, Exception), f"{key}: {res!r}"
    return results


def test_default_device_trap_catches_a_tensor_made_without_device():
    """The trap itself works: a stray ``torch.full`` cannot meet a CPU tensor."""
    x = torch.ones(3)
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        (x * torch.full((3,), 2.0)).sum().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_makes_no_tensor_off_the_model_device(qwen3_dir, dtype):
    model = load_model(str(qwen3_dir), dtype=dtype).model
    tr_rt = TrainingRuntime(model, max_lora_adapters=2)
    unit = tr_rt.create_adapter(LoraSpec(rank=4, seed=0))
    install_lora_weights(model, 1_000_001, LoraSpec(rank=4, seed=0), lora_tensors(tr_rt.unit(unit)))
    sampler = make_sampler(model, qwen3_dir, max_rows=16)
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, V, 7).tolist()
    alt = SampleTask("alt", None, SampleInput(np.asarray(prompt, dtype=np.int64), 1,
                                                SamplingParams(max_tokens=3, temperature=0.7, seed=5),
                                                prompt_logprobs=True, topk_prompt_logprobs=3,
                                                prompt_alt_tokens_k=2))
    with torch.device("meta"):
        results = _ok(run(sampler, [
            task("greedy", prompt, max_tokens=4, temperature=0.0),
            task("plain", prompt, n=3, max_tokens=5, temperature=1.0, seed=1, topk_sample_logprobs=2),
            task("topk", prompt[:3], n=2, max_tokens=6, temperature=1.0, top_k=5, seed=2),
            task("topp", prompt[:5], slot=1_000_001, max_tokens=6, temperature=0.8, top_p=0.9, seed=3),
            task("mixed", prompt[:2], n=2, max_tokens=3, temperature=1.0, top_k=3, top_p=0.5, seed=4),
            alt,
        ]))
    for res in results.values():
        for seq in res.sequences:
            assert np.isfinite(seq.logprobs).all() and (seq.logprobs <= 0).all()


@pytest.mark.parametrize("full", [False, True])
def test_training_makes_no_tensor_off_the_model_device(qwen3_dir, full):
    model = load_model(str(qwen3_dir), dtype=torch.bfloat16).model
    rt = TrainingRuntime(model, full_finetune=full, max_lora_adapters=2, micro_batch_tokens=64,
                         logit_chunk_bytes=4 * model.config.vocab_size * 7)  # 7 rows a chunk: several chunks
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n, model.config.vocab_size) for n in (9, 30, 17)]
    with torch.device("meta"):
        unit = 0 if full else rt.create_adapter(LoraSpec(rank=4, seed=1))
        for loss, cfg in (("cross_entropy", {}), ("importance_sampling", {})):
            if loss == "importance_sampling":
                data = [type(d)(tokens=d.tokens, loss_inputs={
                    "target_tokens": d.loss_inputs["target_tokens"],
                    "logprobs": np.full(len(d.tokens), -2.0, dtype=np.float32),
                    "advantages": rng.normal(size=len(d.tokens)).astype(np.float32)}) for d in data]
            (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, loss, cfg, False))])
            assert not isinstance(res, Exception), res
            assert all(np.isfinite(o["logprobs"]).all() for o in res.outputs)
        # torch < 2.13's AdamW makes its host-side ``step`` counters on the *default* device (2.13
        # names the CPU): there the step itself runs with a CPU default, as it does outside tests.
        with torch.device("cpu") if torch.__version__ < (2, 13) else contextlib.nullcontext():
            metrics = rt.optim_step(unit, AdamParams(learning_rate=1e-4, grad_clip_norm=1.0))
    assert np.isfinite(metrics["grad_norm"])
