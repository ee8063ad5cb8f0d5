"""Image chunks on the wire: decoded exactly as the SDK sends them, hostile images refused with a 400.

Request bodies are built with the ``tinker`` SDK's own types and protobuf encoder; images are
made with Pillow in memory (bombs, huge headers, truncations and wrong formats included).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tinker import types as T
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinsmith.api.codecs import (decode_forward_backward_json, decode_forward_backward_protobuf, decode_sample_request_json,
                                 tokens_only)
from tinsmith.api.codecs._images import check_image
from tinsmith.api.images import check_images_for_model, fit_forward_input, fit_sample_input
from tinsmith.api.limits import RequestLimits
from tinsmith.errors import InvalidInputError
from tinsmith.models.config import ModelConfig, VisionConfig

CAP = 4096 * 4096


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), **save) -> bytes:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def png_with_header(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG whose header claims ``width x height`` (its pixel data may be anything)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def check(data: bytes, fmt: str = "png", expected=None, max_pixels: int = CAP):
    return check_image(data, fmt, expected, position=3, where="prompt.chunks[1]", max_pixels=max_pixels)


@pytest.mark.parametrize("fmt,pil", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_sound_images_are_accepted_with_their_size(fmt, pil):
    data = image_bytes(pil, (9, 5))
    im = check(data, fmt, expected=12)
    assert (im.width, im.height, im.format, im.position, im.expected_tokens) == (9, 5, fmt, 3, 12)
    assert im.data == data


def _refused(data: bytes, *words: str, fmt: str = "png", **kw) -> None:
    with pytest.raises(InvalidInputError) as exc:
        check(data, fmt, **kw)
    msg = str(exc.value)
    assert msg.startswith("prompt.chunks[1]"), msg
    for w in words:
        assert w in msg, msg


def test_wrong_or_unknown_format_is_refused():
    _refused(image_bytes("JPEG"), "not a png image", fmt="png")
    _refused(image_bytes("PNG"), "not a jpeg image", fmt="jpeg")
    _refused(image_bytes("GIF"), "not a png image", fmt="png")
    _refused(image_bytes("PNG"), "format must be one of", fmt="gif")
    _refused(image_bytes("PNG"), "format must be one of", fmt=None)
    _refused(b"%PDF-1.4 not an image at all", "not a png image")
    _refused(b"", "data is empty")


def test_truncated_and_corrupt_images_are_refused():
    png = image_bytes("PNG", (64, 64))
    _refused(png[: len(png) // 2], "damaged or truncated")
    jpeg = image_bytes("JPEG", (64, 64))
    _refused(jpeg[: len(jpeg) // 2], "damaged or truncated", fmt="jpeg")
    _refused(png_with_header(4, 4, idat=b"garbage, not zlib"), "damaged or truncated")
    _refused(png[:20], "png")  # cut inside the header


def test_huge_dimensions_are_refused_from_the_header_before_decoding():
    # 100000 x 100000 claimed by a 60-byte file: decoding it would need 30 GB.
    _refused(png_with_header(100_000, 100_000), "10000000000 pixels", "--max-image-pixels")
    _refused(png_with_header(10_000, 10_000), "10000x10000 image", "--max-image-pixels")
    # Just over a small cap, with real (valid) pixel data
    _refused(image_bytes("PNG", (33, 32)), "33x32 image (1056 pixels)", "limit of 1024", max_pixels=1024)
    assert check(image_bytes("PNG", (32, 32)), max_pixels=1024).width == 32


def test_decompression_bomb_is_refused():
    # 8000 x 8000 black pixels compress to about 60 KB: refused by the cap, never inflated.
    img = Image.new("L", (8000, 8000))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    assert len(buf.getvalue()) < 200_000
    _refused(buf.getvalue(), "8000x8000", "above this server's limit")


def test_animated_images_and_bad_expected_tokens_are_refused():
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    _refused(buf.getvalue(), "animated image (2 frames)")
    for bad in (0, -3, 1.5, "7", True):
        _refused(image_bytes(), "expected_tokens must be a positive integer", expected=bad)


# ---------------------------------------------------------------------------------------------
# Decoding model inputs exactly as the SDK sends them


def _datum(chunks: list, n_rows: int) -> T.Datum:
    return T.Datum(model_input=T.ModelInput(chunks=chunks),
                   loss_fn_inputs={"target_tokens": np.arange(n_rows, dtype=np.int64),
                                   "weights": np.ones(n_rows, dtype=np.float32)})


def _pb_body(data: list[T.Datum]) -> bytes:
    req = T.ForwardBackwardRequest(forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                                   model_id="m", seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_protobuf_forward_backward_carries_images_between_the_tokens():
    png, jpeg = image_bytes("PNG"), image_bytes("JPEG")
    chunks = [T.EncodedTextChunk(tokens=[1, 2]), T.ImageChunk(data=png, format="png", expected_tokens=4),
              T.EncodedTextChunk(tokens=[3]), T.ImageChunk(data=jpeg, format="jpeg", expected_tokens=2)]
    _, _, inp = decode_forward_backward_protobuf(_pb_body([_datum(chunks, 3 + 4 + 2)]))
    d = inp.data[0]
    assert d.tokens.tolist() == [1, 2, 3]
    assert [(im.position, im.format, im.expected_tokens, im.where) for im in d.images] == [
        (2, "png", 4, "data[0].model_input[1]"), (3, "jpeg", 2, "data[0].model_input[3]")]
    assert d.images[0].data == png
    # the loss inputs align with text + expected image tokens
    with pytest.raises(InvalidInputError, match="has 8 rows but model_input has 9 tokens"):
        decode_forward_backward_protobuf(_pb_body([_datum(chunks, 8)]))
    # without expected_tokens the row count waits for the model's processor
    chunks[1] = T.ImageChunk(data=png, format="png")
    _, _, inp = decode_forward_backward_protobuf(_pb_body([_datum(chunks, 5)]))
    assert inp.data[0].images[0].expected_tokens is None


def test_protobuf_image_is_checked_with_the_server_cap():
    limits = RequestLimits(num_samples=4, sample_tokens=None, prompt_tokens=None, forward_datums=8,
                           forward_tokens=1000, dense_elements=10_000, image_pixels=40)
    chunks = [T.EncodedTextChunk(tokens=[1]), T.ImageChunk(data=image_bytes("PNG", (8, 6)), format="png")]
    with pytest.raises(InvalidInputError, match=r"data\[0\].model_input\[1\].data is a 8x6 image"):
        decode_forward_backward_protobuf(_pb_body([_datum(chunks, 1)]), limits=limits)


def test_json_model_inputs_with_images():
    png = image_bytes("PNG")
    # the JSON form the SDK's pydantic chunk types write
    chunks = [{"type": "encoded_text", "tokens": [5, 6]},
              T.ImageChunk(data=png, format="png", expected_tokens=3).model_dump(mode="json")]
    datum = {"model_input": {"chunks": chunks},
             "loss_fn_inputs": {"target_tokens": {"data": [1] * 5, "dtype": "int64", "shape": [5]}}}
    body = {"forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}, "model_id": "m", "seq_id": 1}
    assert chunks[1]["data"] == base64.b64encode(png).decode()
    _, _, inp = decode_forward_backward_json(body)
    im = inp.data[0].images[0]
    assert (im.position, im.where, im.data) == (2, "data[0].model_input.chunks[1]", png)

    prompt = {"chunks": [T.ImageChunk(data=png, format="png").model_dump(mode="json"),
                         {"type": "encoded_text", "tokens": [7]}]}
    sample = {"sampling_session_id": "s", "seq_id": 0, "num_samples": 1, "prompt": prompt,
              "sampling_params": {"max_tokens": 2}, "prompt_logprobs": True}
    inp = decode_sample_request_json(sample)[4]
    assert inp.prompt.tolist() == [7] and inp.prompt_images[0].where == "prompt.chunks[0]"

    bad = dict(sample, prompt={"chunks": [{"type": "image", "data": "***", "format": "png"}]})
    with pytest.raises(InvalidInputError, match=r"prompt.chunks\[0\].data is not valid base64"):
        decode_sample_request_json(bad)
    pointer = T.ImageAssetPointerChunk(format="png", location="file:///etc/passwd")
    bad = dict(sample, prompt={"chunks": [pointer.model_dump(mode="json")]})
    with pytest.raises(InvalidInputError, match=r"prompt.chunks\[0\] is a 'image_asset_pointer' chunk: .*does not fetch"):
        decode_sample_request_json(bad)
    for key, value in (("prompt_logprobs_last_n", 1), ("prompt_alt_tokens_k", 2)):
        with pytest.raises(InvalidInputError, match=f"{key} is not supported for a prompt with image chunks"):
            decode_sample_request_json(dict(sample, **{key: value}))


def test_only_prompts_of_tokens_alone_count_as_tokens_only():
    """asample decodes a small prompt of tokens on the event loop and anything else in a thread."""
    png = image_bytes("PNG")
    image = T.ImageChunk(data=png, format="png").model_dump(mode="json")
    pointer = T.ImageAssetPointerChunk(format="png", location="file:///x").model_dump(mode="json")
    text = {"type": "encoded_text", "tokens": [7]}
    assert tokens_only({"chunks": [text, {"tokens": [8]}]}) and tokens_only({"chunks": []})
    for prompt in ({"chunks": [text, image]}, {"chunks": [pointer]}, {"chunks": [{"type": None, "tokens": [1]}]},
                   {"chunks": [[1]]}, {"chunks": "x"}, {"tokens": [1]}, [text], None):
        assert not tokens_only(prompt), prompt


def test_override_dimensions_is_refused():
    msg = forward_backward_request_to_proto(T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(
            data=[_datum([T.ImageChunk(data=image_bytes(), format="png", expected_tokens=1)], 1)],
            loss_fn="cross_entropy"),
        model_id="m", seq_id=1))
    msg.data[0].model_input[0].image.override_dimensions.width = 4
    with pytest.raises(InvalidInputError, match=r"model_input\[0\].override_dimensions is not supported"):
        decode_forward_backward_protobuf(msg.SerializeToString())


def test_text_only_model_refuses_images_by_name():
    config = ModelConfig(architecture="Qwen3ForCausalLM", family="qwen3", vocab_size=10, hidden_size=4,
                         intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                         max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
    check_images_for_model([], "tiny", config)  # no image: nothing to say
    im = check(image_bytes())
    with pytest.raises(InvalidInputError) as exc:
        check_images_for_model([im], "Qwen/Qwen3-8B", config)
    assert str(exc.value).startswith("prompt.chunks[1] is an image, but base model 'Qwen/Qwen3-8B' is a text-only model")
    vl = VisionConfig(image_token_id=9, vision_start_token_id=8, patch_size=16, merge_size=2, temporal_patch_size=2)
    check_images_for_model([im], "vl", ModelConfig(**{**config.__dict__, "vision": vl}))
    # an image-text checkpoint served as text only says why, not that the model is text-only
    off = ModelConfig(**{**config.__dict__, "architecture": "Qwen3_5ForConditionalGeneration",
                         "images_off": "its directory holds no preprocessor_config.json"})
    with pytest.raises(InvalidInputError) as exc:
        check_images_for_model([im], "Qwen/Qwen3.5-27B", off)
    assert str(exc.value) == ("prompt.chunks[1] is an image, but base model 'Qwen/Qwen3.5-27B' "
                              "(Qwen3_5ForConditionalGeneration) is served as text only: its directory holds no "
                              "preprocessor_config.json")


def test_image_text_model_expands_images_by_its_processor_count():
    config = ModelConfig(architecture="Qwen3VLForConditionalGeneration", family="qwen3_vl", vocab_size=10,
                         hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
                         max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         vision=VisionConfig(image_token_id=9, vision_start_token_id=8, patch_size=16, merge_size=2,
                                             temporal_patch_size=2))
    counts = {(8, 6): 3, (16, 16): 2}
    count = lambda w, h: counts[(w, h)]  # noqa: E731
    sample = decode_sample_request_json({"sampling_session_id": "s", "seq_id": 0, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [1, 8]}, T.ImageChunk(data=image_bytes(), format="png").model_dump(mode="json"),
        {"type": "encoded_text", "tokens": [2]},
        T.ImageChunk(data=image_bytes(size=(16, 16)), format="png", expected_tokens=2).model_dump(mode="json")]}})[4]
    fit_sample_input(sample, "vl", config, count)
    assert sample.prompt.tolist() == [1, 8, 9, 9, 9, 2, 9, 9]
    assert [(im.position, im.expected_tokens) for im in sample.prompt_images] == [(2, 3), (6, 2)]

    def fb(expected: int, rows: int, text=(1, 2)):
        chunks = [T.EncodedTextChunk(tokens=list(text)), T.ImageChunk(data=image_bytes(), format="png", expected_tokens=expected)]
        return decode_forward_backward_protobuf(_pb_body([_datum(chunks, rows)]))[2]

    inp = fb(3, 5)
    fit_forward_input(inp, "vl", config, count)
    assert inp.data[0].tokens.tolist() == [1, 2, 9, 9, 9] and inp.data[0].images[0].position == 2
    with pytest.raises(InvalidInputError, match=r"data\[0\].model_input\[1\].expected_tokens is 4, but base model 'vl' makes 3"):
        fit_forward_input(fb(4, 6), "vl", config, count)
    with pytest.raises(InvalidInputError, match=r"data\[0\].model_input holds the image placeholder token id 9"):
        fit_forward_input(fb(3, 5, text=(1, 9)), "vl", config, count)
