"""Image chunks against the model they are sent to: a text-only model refuses them by name.

The codecs check an image's bytes on arrival (``tinsmith.api.codecs._images``); whether a
request may carry images at all depends on the base model of the run or sampler it targets,
which only the route knows.
"""

from __future__ import annotations

from collections.abc import Iterable

from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig
from tinsmith.types import ImageInput


def check_images_for_model(images: Iterable[ImageInput], base_model: str, config: ModelConfig) -> None:
    """400 naming the first image chunk when ``base_model`` does not take images."""
    first = next(iter(images), None)
    if first is None:
        return
    if config.vision is None:
        raise InvalidInputError(
            f"{first.where} is an image, but base model {base_model!r} is a text-only model "
            f"({config.architecture}); it takes no image input"
        )
    raise InvalidInputError(
        f"{first.where} is an image; image input for base model {base_model!r} is not served yet"
    )
