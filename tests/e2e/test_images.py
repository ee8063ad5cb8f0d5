"""Images in prompts through the real SDK: a text-only base model refuses them with a 400 naming it.

Every call that carries a model input (forward_backward, forward, sample, compute_logprobs)
is tried with an ``ImageChunk``; hostile images are refused before the model is asked. After each
case the server must have logged no internal error, and the run must still train on text.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types

from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, lora_client, loss_sum

pytestmark = pytest.mark.e2e


def png(size: tuple[int, int] = (16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_prompt(data: bytes, fmt: str = "png") -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2, 3]),
                                    types.ImageChunk(data=data, format=fmt, expected_tokens=4),
                                    types.EncodedTextChunk(tokens=[4, 5])])


def image_datum(data: bytes) -> types.Datum:
    return types.Datum(model_input=image_prompt(data),
                       loss_fn_inputs={"target_tokens": np.arange(9, dtype=np.int64) % 7 + 1})


@pytest.fixture
def tc(sc, base_model):
    return lora_client(sc, base_model, rank=4, seed=0)


@pytest.fixture(autouse=True)
def _no_internal_errors(server):
    before = len(server.log_text())
    yield
    assert_no_internal_errors(server.log_text()[before:])


def _bad_request(call) -> str:
    with pytest.raises(tinker.BadRequestError) as exc:
        call().result(timeout=RESULT_TIMEOUT_S)
    return str(exc.value)


def test_text_only_model_refuses_images_in_every_call(tc, base_model):
    want = f"is an image, but base model {base_model!r} is a text-only model"
    msg = _bad_request(lambda: tc.forward_backward([image_datum(png())], "cross_entropy"))
    assert "data[0].model_input[1] " + want in msg, msg
    msg = _bad_request(lambda: tc.forward([image_datum(png())], "cross_entropy"))
    assert "data[0].model_input[1] " + want in msg, msg

    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    msg = _bad_request(lambda: sampler.sample(image_prompt(png()), 1, params))
    assert "prompt.chunks[1] " + want in msg, msg
    msg = _bad_request(lambda: sampler.compute_logprobs(image_prompt(png())))
    assert "prompt.chunks[1] " + want in msg, msg

    # the run is untouched: text still trains
    text = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": np.array([2, 3, 4], dtype=np.int64)})
    assert np.isfinite(loss_sum(tc.forward_backward([text], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)))


def test_hostile_images_are_refused_by_field(tc):
    good = png((32, 32))
    jpeg_buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg_buf, "JPEG")
    bomb_buf = io.BytesIO()
    Image.new("L", (6000, 6000)).save(bomb_buf, "PNG")  # 36 Mpixels in about 35 KB
    cases = {
        "damaged or truncated": good[: len(good) // 2],
        "is not a png image": jpeg_buf.getvalue(),
        "above this server's limit": bomb_buf.getvalue(),
    }
    for words, data in cases.items():
        msg = _bad_request(lambda: tc.forward_backward([image_datum(data)], "cross_entropy"))
        assert "data[0].model_input[1].data" in msg and words in msg, (words, msg)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    msg = _bad_request(lambda: sampler.sample(image_prompt(good[:40]), 1, types.SamplingParams(max_tokens=1)))
    assert "prompt.chunks[1].data" in msg, msg
