"""Image-text models on the GPU (Qwen3-VL; Qwen3.5 as released, dense and MoE): the vision tower
and the decoder on the device give, in fp32, what the CPU gives, which tests/models checks against
transformers. Sampling after an image goes through the sampler's CUDA graphs, with each row's
multimodal rope delta; separate requests of one image prompt share its prefill; a LoRA step on
datums with images gives the CPU's logprobs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import QWEN3_5_VL, SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import run_to_end
from tests.parallel.test_tp_vision import _with_image
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.models.loading import load_model
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import Datum, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

pytestmark = pytest.mark.gpu

SHAPES = {"qwen3_vl": SMALL, "qwen3_5_vl": QWEN3_5_VL, "qwen3_5_moe_vl": QWEN3_5_VL}


def _sampled(loaded) -> dict:
    """Greedy and seeded samples of two image prompts, the second sent as three requests."""
    vision, cfg = loaded.vision, loaded.config.vision
    tasks = []
    for p, seed in enumerate((2, 3)):
        prompt, images = _with_image(vision, cfg, seed)
        for r in range(1 if p == 0 else 3):
            params = SamplingParams(max_tokens=12, temperature=0.0 if r == 0 else 1.0, seed=r, stop=[])
            tasks.append(SampleTask((p, r), None, SampleInput(prompt, 2, params, prompt_images=images)))
    sampler = Sampler(loaded.model, lambda t: "", vision=vision, cuda_graphs=True)
    out = run_to_end(sampler, tasks)
    assert sampler.stats["prefills"] == 2  # the second prompt's three requests shared one
    return out


def _trained(loaded) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    rt = TrainingRuntime(loaded.model, vision=loaded.vision, max_lora_adapters=1, max_lora_rank=8, packing=True)
    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    data = []
    for seed in (4, 5):
        tokens, images = _with_image(loaded.vision, loaded.config.vision, seed)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)},
                          images=images))
    text = np.random.default_rng(6).integers(10, 300, 20)
    data.append(Datum(text[:-1], {"target_tokens": text[1:], "weights": np.ones(19, np.float32)}))
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))])
    grads = {n: p.grad.detach().float().cpu() for n, p in rt.unit(unit).named_stepped if p.grad is not None}
    return [np.asarray(o["logprobs"]) for o in res.outputs], grads


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_image_text_models_sample_and_train_on_the_gpu_as_on_the_cpu(tmp_path, family, monkeypatch):
    # The towers' patch embedding is a 3-D convolution, which cuDNN runs in tf32 unless told
    # otherwise: the image features then differ from the CPU's by about 1e-3 relative, and so do
    # the logprobs and gradients after them (an H200 run: 1.2e-3 on logprobs near -5.8).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model_dir = make_tiny_model(tmp_path / family, family, SHAPES[family], seed=1)
    cpu = load_model(str(model_dir), "cpu", torch.float32)
    gpu = load_model(str(model_dir), DEVICE, torch.float32)
    assert gpu.vision is not None and next(gpu.vision.model.parameters()).device.type == torch.device(DEVICE).type
    ref, got = _sampled(cpu), _sampled(gpu)
    for key, res in ref.items():
        for a, b in zip(res.sequences, got[key].sequences):
            assert b.tokens.tolist() == a.tokens.tolist(), key
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-3, rtol=0, err_msg=str(key))
    (ref_lps, ref_grads), (lps, grads) = _trained(cpu), _trained(gpu)
    for a, b in zip(ref_lps, lps):
        np.testing.assert_allclose(b, a, atol=1e-3, rtol=0)
    assert ref_grads.keys() == grads.keys() and ref_grads
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-3, atol=1e-4, msg=n)
