"""Image chunks of a model input: decoded from the wire and checked before anything trusts them.

An image arrives as raw encoded bytes (``ImageChunk.data``: base64 in JSON, raw in protobuf).
Encoded images are a classic attack surface, so each one is checked here, on arrival, with
Pillow: the declared format must be on the allow-list and match the bytes; the pixel count is
read from the header and refused above the server's cap *before* any pixel is decoded (a
decompression bomb never gets to allocate); then the image is decoded in full, so truncated or
corrupt data is a 400 now rather than a failure inside a batch of other tenants' work.
Animated images (APNG, animated WebP) are refused: a prompt image is one still picture.

How many tokens an image becomes is the base model's business (its processor); this module
only says the bytes are a sound image of a known size.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

from tinsmith.types import ImageInput

from ._common import fail, is_int

# Wire ``format`` -> Pillow's format name. The SDK sends "png" or "jpeg"; WebP costs nothing more.
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}

# Default pixel cap (width x height) of one image: 4096 x 4096, the largest image Qwen-VL
# processors keep at full size (``longest_edge`` 16,777,216 pixels).
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096

_INT32_MAX = (1 << 31) - 1


def check_image(data: bytes, fmt: Any, expected_tokens: Any, *, position: int, where: str,
                max_pixels: int) -> ImageInput:
    """The checked :class:`ImageInput` for one image chunk, or a 400 naming ``where``."""
    if not isinstance(fmt, str) or fmt not in IMAGE_FORMATS:
        fail(f"{where}.format must be one of {', '.join(IMAGE_FORMATS)}, got {fmt!r}")
    if expected_tokens is not None and (not is_int(expected_tokens)
                                        or not 0 < expected_tokens <= _INT32_MAX):
        fail(f"{where}.expected_tokens must be a positive integer, got {expected_tokens!r}")
    if not data:
        fail(f"{where}.data is empty")
    pil_format = IMAGE_FORMATS[fmt]
    try:
        with warnings.catch_warnings():
            # Our own cap below replaces Pillow's global bomb warning/error.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[pil_format]) as img:
                width, height = img.size
                if width < 1 or height < 1:
                    fail(f"{where}.data is a {width}x{height} image; it has no pixels")
                if width * height > max_pixels:
                    fail(f"{where}.data is a {width}x{height} image ({width * height} pixels), above this "
                         f"server's limit of {max_pixels} pixels per image (set by --max-image-pixels)")
                if getattr(img, "n_frames", 1) != 1:
                    fail(f"{where}.data is an animated image ({img.n_frames} frames); send one still image")
                img.load()
    except UnidentifiedImageError:
        fail(f"{where}.data is not a {fmt} image (its bytes do not decode as {fmt}; "
             f"{where}.format must name the image's real format)")
    except Image.DecompressionBombError as e:
        fail(f"{where}.data is refused as a decompression bomb, above this server's limit of {max_pixels} "
             f"pixels per image (set by --max-image-pixels): {e}")
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        fail(f"{where}.data is a damaged or truncated {fmt} image: {e}")
    return ImageInput(data=bytes(data), format=fmt, width=width, height=height, position=position,
                      expected_tokens=expected_tokens, where=where)


def json_image_bytes(value: Any, where: str) -> bytes:
    """The bytes of a JSON ``ImageChunk.data`` (standard base64, as the SDK writes it)."""
    if not isinstance(value, str):
        fail(f"{where}.data must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        fail(f"{where}.data is not valid base64")
