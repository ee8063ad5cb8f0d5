"""Image chunks against the model they are sent to: token counts from its processor, or a 400.

The codecs check an image's bytes on arrival (``tinsmith.api.codecs._images``); what an image
means depends on the base model of the run or sampler a request targets, which only the route
knows. A text-only model refuses images by name. An image-text model turns each image into as
many image tokens as its own processor says: the model input is expanded here, once, so every
later check (loss inputs' rows, context length) and the worker see the sequence the model runs,
and each image's ``position`` becomes the start of its tokens in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from tinsmith.api.codecs._common import check_rows, check_spans
from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig
from tinsmith.models.vision import expand_tokens
from tinsmith.types import ForwardBackwardInput, ImageInput, SampleInput

TokenCounter = Callable[[int, int], int]  # (width, height) -> image tokens, the model's processor's count


def check_images_for_model(images: Iterable[ImageInput], base_model: str, config: ModelConfig) -> None:
    """400 naming the first image chunk when ``base_model`` does not take images."""
    first = next(iter(images), None)
    if first is not None and config.vision is None:
        raise InvalidInputError(f"{first.where} is an image, but {no_images(base_model, config)}")


def no_images(base_model: str, config: ModelConfig) -> str:
    """Why ``base_model`` (a model without vision) takes no image input, for a refusal's message."""
    if config.images_off is not None:
        return f"base model {base_model!r} ({config.architecture}) is served as text only: {config.images_off}"
    return f"base model {base_model!r} is a text-only model ({config.architecture}); it takes no image input"


def _fit(tokens: np.ndarray, images: list[ImageInput], where: str, base_model: str, config: ModelConfig,
         count: TokenCounter) -> tuple[np.ndarray, list[ImageInput]]:
    """Expand one model input for an image-text model (checked against its processor)."""
    vision = config.vision
    assert vision is not None
    if tokens.size and bool((tokens == vision.image_token_id).any()):
        raise InvalidInputError(
            f"{where} holds the image placeholder token id {vision.image_token_id} in its text; "
            "send each image as an image chunk (its tokens are made from it)"
        )
    if not images:
        return tokens, images
    counts = []
    for im in images:
        try:
            n = count(im.width, im.height)
        except ValueError as e:  # e.g. an aspect ratio the processor cannot resize within its bounds
            raise InvalidInputError(
                f"{im.where} is a {im.width}x{im.height} image that base model {base_model!r}'s image "
                f"processor refuses: {e}") from None
        if im.expected_tokens is not None and im.expected_tokens != n:
            raise InvalidInputError(
                f"{im.where}.expected_tokens is {im.expected_tokens}, but base model {base_model!r} makes "
                f"{n} tokens of this {im.width}x{im.height} image"
            )
        counts.append(n)
    expanded, starts = expand_tokens(tokens, images, counts, vision.image_token_id)
    return expanded, [dataclasses.replace(im, position=s, expected_tokens=n)
                      for im, s, n in zip(images, starts, counts)]


def fit_forward_input(inp: ForwardBackwardInput, base_model: str, config: ModelConfig,
                      count: TokenCounter | None) -> None:
    """Check (text-only model) or expand (image-text model) every datum's images, in place."""
    check_images_for_model((im for d in inp.data for im in d.images), base_model, config)
    if config.vision is None or count is None:
        return
    for i, d in enumerate(inp.data):
        d.tokens, d.images = _fit(d.tokens, d.images, f"data[{i}].model_input", base_model, config, count)
        n = int(d.tokens.size)
        for key, arr in d.loss_inputs.items():
            check_rows(f"data[{i}].loss_fn_inputs[{key!r}]", arr, n)
        check_spans(f"data[{i}].model_input_spans", d.model_input_spans, n, "model_input")
        check_spans(f"data[{i}].loss_fn_input_spans", d.loss_input_spans, n, "loss_fn_inputs (rows)")


def fit_sample_input(inp: SampleInput, base_model: str, config: ModelConfig, count: TokenCounter | None) -> None:
    """The same for a sampling prompt."""
    check_images_for_model(inp.prompt_images, base_model, config)
    if config.vision is None or count is None:
        return
    inp.prompt, inp.prompt_images = _fit(inp.prompt, inp.prompt_images, "prompt", base_model, config, count)

