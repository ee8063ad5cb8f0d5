"""Image-text Qwen3.5 and Qwen3.5-MoE (``Qwen3_5ForConditionalGeneration`` checkpoints, as released):
tinsmith's hybrid decoder with multimodal RoPE in its attention layers, fed by the frozen vision
tower, against transformers' own class, in logits, in greedy decoding after an image, and in a
training step."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # not transformers.AutoImageProcessor: 5.17 demands torchvision there

from tests.models.test_qwen3_vl import image, ours
from tinsmith.models.loading import load_model
from tinsmith.models.vision import expand_tokens
from tinsmith.sampling.sampler import Sampler, SampleTask
from tinsmith.types import Datum, ForwardBackwardInput, ImageInput, LoraSpec, SampleInput, SamplingParams
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

CLASSES = {"qwen3_5_vl_dir": transformers.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe_vl_dir": transformers.Qwen3_5MoeForConditionalGeneration}


@pytest.fixture(params=sorted(CLASSES), ids=["moe", "dense"])
def family(request):
    """(checkpoint directory, transformers' image-text class) of the dense and the MoE model."""
    return request.getfixturevalue(request.param), CLASSES[request.param]


def _reference(cls, model_dir, tokens, images: list[ImageInput]):
    """transformers' logits of ``tokens`` (expanded) with ``images``, and its rope delta."""
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = _pixels(model_dir, images)
    ids = torch.as_tensor(np.asarray(tokens))[None]
    with torch.no_grad():
        out = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **inputs)
    return out.logits[0], model.model.rope_deltas


def _pixels(model_dir, images: list[ImageInput]) -> dict:
    proc = AutoImageProcessor.from_pretrained(model_dir)
    batch = proc(images=[Image.open(io.BytesIO(im.data)).convert("RGB") for im in images], return_tensors="pt")
    return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}


def _prompt(loaded, seed: int) -> tuple[np.ndarray, list[ImageInput]]:
    """Text around one image, expanded to its image tokens (the image placed at their start)."""
    cfg = loaded.config.vision
    rng = np.random.default_rng(seed)
    text = np.concatenate([rng.integers(10, 300, 4), [cfg.vision_start_token_id], rng.integers(10, 300, 3)])
    im = image(70, 50, position=5, seed=seed)
    expanded, starts = expand_tokens(text, [im], [loaded.vision.num_tokens(im.width, im.height)], cfg.image_token_id)
    return expanded, [ImageInput(**{**im.__dict__, "position": starts[0]})]


def test_an_image_text_checkpoint_loads_its_vision_tower(family):
    model_dir, _ = family
    loaded = load_model(str(model_dir))
    assert loaded.vision is not None and loaded.config.vision.tower == loaded.config.family
    assert loaded.config.rope.mrope_section == (11, 11, 10)  # transformers' default: config.json names none
    assert loaded.model.supports_packing  # micro-batches without images still pack


def test_logits_with_images_match_transformers(family):
    model_dir, cls = family
    loaded = load_model(str(model_dir))
    cfg = loaded.config.vision
    text = np.array([10, 11, cfg.vision_start_token_id, 300, 12, cfg.vision_start_token_id, 13, 14, 15], dtype=np.int64)
    images = [image(70, 50, position=3, seed=1), image(40, 90, position=6, seed=2)]
    logits, tokens, delta = ours(loaded, text, images)
    assert (tokens == cfg.image_token_id).sum() > 4
    expected, ref_delta = _reference(cls, model_dir, tokens, images)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert delta == int(ref_delta[0, 0]) and delta < 0
    # the image moved the later text's positions: without it the same tokens read otherwise
    with torch.no_grad():
        plain = loaded.model.logits(loaded.model.hidden_states(torch.as_tensor(tokens)[None],
                                                               torch.arange(len(tokens))[None]))[0]
    assert (plain[-1] - logits[-1]).abs().max() > 1e-3


def test_greedy_decoding_after_an_image_matches_transformers_generate(family):
    """The prefill writes the attention layers' K/V at multimodal positions and the DeltaNet
    layers' recurrent state after the image; decoding goes on at position + rope delta."""
    model_dir, cls = family
    loaded = load_model(str(model_dir))
    prompt, images = _prompt(loaded, seed=3)
    sampler = Sampler(loaded.model, lambda ids: "", vision=loaded.vision)
    sampler.add(SampleTask("greedy", None, SampleInput(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                                                       prompt_images=images)))
    got = None
    while sampler.has_work():
        for _, r in sampler.step(budget_s=3600.0):
            if isinstance(r, Exception):
                raise r
            got = r.sequences[0]
    ref = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompt)[None]
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           mm_token_type_ids=(ids == ref.config.image_token_id).int(), **_pixels(model_dir, images))
    expected = out[0, len(prompt):].tolist()
    assert list(got.tokens) == expected
    # ... and its logprobs are a forward pass's over the whole sequence
    full = np.concatenate([prompt, expected[:-1]])
    logits, _ = _reference(cls, model_dir, full, images)
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:].gather(-1, torch.tensor(expected)[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(got.logprobs), lp.numpy(), atol=1e-4)


def test_training_with_an_image_beside_text_rows(family):
    """A micro-batch with an image runs padded with its multimodal positions, one of text alone is
    packed: both give transformers' logprobs, and the step moves the adapter."""
    model_dir, cls = family
    loaded = load_model(str(model_dir))
    rt = TrainingRuntime(loaded.model, vision=loaded.vision, max_lora_adapters=1, max_lora_rank=8, packing=True)
    assert rt.packing
    unit = rt.create_adapter(LoraSpec(rank=4, seed=1))
    tokens, images = _prompt(loaded, seed=4)
    rng = np.random.default_rng(5)
    text = [rng.integers(10, 300, n) for n in (9, 14)]

    def datum(toks, ims=()):
        return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(len(toks) - 1, np.float32)}, images=list(ims))

    data = [datum(tokens, images)] + [datum(t) for t in text]
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy"))])
    ref = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, toks in enumerate([tokens] + text):
        ids = torch.as_tensor(toks[:-1])[None]
        extra = _pixels(model_dir, images) if i == 0 else {}
        with torch.no_grad():
            logits = ref(input_ids=ids, mm_token_type_ids=(ids == ref.config.image_token_id).int(), **extra).logits[0]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(toks[1:])[:, None])[:, 0]
        np.testing.assert_allclose(res.outputs[i]["logprobs"], expected.numpy(), atol=1e-4)
    grads = [p.grad for _, p in rt.unit(unit).named_stepped]
    assert any(g is not None and g.abs().max() > 0 for g in grads)
