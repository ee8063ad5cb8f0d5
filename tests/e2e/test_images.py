"""Images in prompts through the real SDK.

A text-only base model refuses them with a 400 naming it, for every call that carries a model
input (forward_backward, forward, sample, compute_logprobs); hostile images are refused before
the model is asked. A tiny random Qwen3-VL, and a tiny image-text Qwen3.5 (as released), take
them: forward equals transformers, training lowers the loss, sampling after an image matches
forward. After each case the server must have
logged no internal error.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
import transformers
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # not transformers.AutoImageProcessor: 5.17 demands torchvision there
from PIL import Image
from tinker import types

from tests.conftest import QWEN3_5_VL, SMALL
from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, lora_client, loss_sum
from tests.e2e.server import ServerProcess
from tests.rl.helpers import full_finetune_client
from tinsmith.devtools.tiny_model import make_tiny_model

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


# ---------------------------------------------------------------------------------------------
# An image-text base model (a tiny random Qwen3-VL): images become tokens through its processor


# The tiny image-text checkpoints served (Qwen3-VL; Qwen3.5 as released), by their shapes.
VL_MODELS = {"qwen3_vl": SMALL, "qwen3_5_vl": QWEN3_5_VL}


@pytest.fixture(scope="module", params=sorted(VL_MODELS))
def vl_server(tmp_path_factory, request):
    family = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp("vl-model") / family, family, VL_MODELS[family], seed=5)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("vl-data")).start()
    yield srv
    assert_no_internal_errors(srv.log_text())
    srv.stop()


def _vl_ids(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _image_tokens(model_dir: str, data: bytes) -> int:
    w, h = Image.open(io.BytesIO(data)).size
    return AutoImageProcessor.from_pretrained(model_dir).get_number_of_image_patches(h, w, {}) // 4


def _vl_class(model_dir) -> type:
    """transformers' image-text class of the checkpoint (its config's ``architectures``)."""
    return getattr(transformers, _vl_ids(model_dir)["architectures"][0])


def _hf_logprobs(model_dir: str, tokens: list[int], data: bytes) -> np.ndarray:
    """transformers' image-text class: log p(tokens[i+1] | tokens[:i+1]) with the image in place."""
    model = _vl_class(model_dir).from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(model_dir)
    batch = proc(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                       mm_token_type_ids=(ids == model.config.image_token_id).int()).logits[0]
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return lp.numpy()


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_vl_model_trains_and_samples_with_images(vl_server, kind):
    """A LoRA run, and a full fine-tune of the decoder (the vision tower stays frozen), whose
    stored sampler weights are then a whole image-text checkpoint that transformers loads with the
    trained logprobs."""
    model_dir = vl_server.base_model
    ids = _vl_ids(model_dir)
    data = png((70, 90))
    n_img = _image_tokens(model_dir, data)
    assert n_img > 4
    before, after = [30, 31, ids["vision_start_token_id"]], [ids["vision_end_token_id"], 40, 41, 42, 43, 44, 45]
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                      types.ImageChunk(data=data, format="png", expected_tokens=n_img),
                                      types.EncodedTextChunk(tokens=after)])
    full = before + [ids["image_token_id"]] * n_img + after
    targets = np.array(full[1:] + [0], dtype=np.int64)
    weights = np.array([0.0 if t == ids["image_token_id"] else 1.0 for t in full[1:]] + [0.0], dtype=np.float32)
    datum = types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets, "weights": weights})

    sc = tinker.ServiceClient(base_url=vl_server.base_url, api_key="tml-vl")
    tc = lora_client(sc, model_dir, rank=4, seed=0) if kind == "lora" else full_finetune_client(sc, model_dir)
    # A fresh adapter (or full fine-tune) is the base model: forward equals transformers' Qwen3-VL
    fwd = tc.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    lp0 = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert lp0.shape == (len(full),)
    np.testing.assert_allclose(lp0[:-1], _hf_logprobs(model_dir, full, data), atol=1e-4)

    losses = []
    for _ in range(12):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2 if kind == "lora" else 2e-3)).result(timeout=RESULT_TIMEOUT_S)
        losses.append(loss_sum(fb.result(timeout=RESULT_TIMEOUT_S)))
    assert losses[-1] < 0.5 * losses[0], losses

    trained = np.asarray(tc.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                         .loss_fn_outputs[0]["logprobs"].to_numpy())
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
    # The sampler's prompt logprobs with the image equal the trainer's forward
    plp = sampler.compute_logprobs(prompt).result(timeout=RESULT_TIMEOUT_S)
    assert len(plp) == len(full) and plp[0] is None
    np.testing.assert_allclose(np.array(plp[1:], dtype=np.float64), trained[:-1], atol=1e-4)
    # Greedy decoding continues the trained text, its positions after the image's M-RoPE ones
    short = types.ModelInput(chunks=[*prompt.chunks[:2], types.EncodedTextChunk(tokens=after[:2])])
    out = sampler.sample(short, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=RESULT_TIMEOUT_S)
    assert list(out.sequences[0].tokens) == after[2:6]
    # ... and a sample's logprobs are the trained model's over the whole sequence
    seq = list(out.sequences[0].tokens)
    short_full = before + [ids["image_token_id"]] * n_img + after[:2]
    whole = types.Datum(model_input=types.ModelInput(chunks=[*short.chunks, types.EncodedTextChunk(tokens=seq[:-1])]),
                        loss_fn_inputs={"target_tokens": np.array(short_full[1:] + seq, dtype=np.int64)})
    got = np.asarray(tc.forward([whole], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                     .loss_fn_outputs[0]["logprobs"].to_numpy())
    np.testing.assert_allclose(got[-4:], np.asarray(out.sequences[0].logprobs), atol=1e-4)
    if kind == "full":  # the stored sampler weights: the image-text class, vision tower included
        tc.save_weights_for_sampler("vl-full").result(timeout=RESULT_TIMEOUT_S)
        (export,) = [p for p in vl_server.data_dir.rglob("vl-full") if p.is_dir()]
        _, info = _vl_class(export).from_pretrained(export, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        np.testing.assert_allclose(_hf_logprobs(str(export), full, data), trained[:-1], atol=1e-4)
    sc.close("success").result(timeout=60)


def test_vl_model_refuses_mismatched_images(vl_server):
    model_dir = vl_server.base_model
    ids = _vl_ids(model_dir)
    data = png((48, 40))
    n_img = _image_tokens(model_dir, data)
    sc = tinker.ServiceClient(base_url=vl_server.base_url, api_key="tml-vl-bad")
    tc = lora_client(sc, model_dir, rank=4, seed=0)

    def datum(chunks, n):
        return types.Datum(model_input=types.ModelInput(chunks=chunks),
                           loss_fn_inputs={"target_tokens": np.ones(n, dtype=np.int64)})

    img = types.ImageChunk(data=data, format="png", expected_tokens=n_img + 1)
    msg = _bad_request(lambda: tc.forward([datum([types.EncodedTextChunk(tokens=[1]), img], n_img + 2)], "cross_entropy"))
    assert f"data[0].model_input[1].expected_tokens is {n_img + 1}, but base model" in msg and f"makes {n_img}" in msg
    img = types.ImageChunk(data=data, format="png")  # no expected_tokens: rows are checked against the processor
    msg = _bad_request(lambda: tc.forward([datum([types.EncodedTextChunk(tokens=[1]), img], n_img + 3)], "cross_entropy"))
    assert f"has {n_img + 3} rows but model_input has {n_img + 1} tokens" in msg, msg
    msg = _bad_request(lambda: tc.forward([datum([types.EncodedTextChunk(tokens=[1, ids["image_token_id"]])], 2)],
                                          "cross_entropy"))
    assert "holds the image placeholder token id" in msg, msg
    thin = types.ImageChunk(data=png((1000, 2)), format="png")
    msg = _bad_request(lambda: tc.forward([datum([types.EncodedTextChunk(tokens=[1]), thin], 5)], "cross_entropy"))
    assert "data[0].model_input[1] is a 1000x2 image that base model" in msg and "aspect ratio" in msg, msg
    # a one-pixel image is fine: the processor scales it up to its minimum
    dot = types.ImageChunk(data=png((1, 1)), format="png")
    n_dot = _image_tokens(model_dir, png((1, 1)))
    out = tc.forward([datum([types.EncodedTextChunk(tokens=[1]), dot], 1 + n_dot)], "cross_entropy")
    assert np.isfinite(out.result(timeout=RESULT_TIMEOUT_S).loss_fn_outputs[0]["logprobs"].to_numpy()).all()
    sc.close("success").result(timeout=60)


def test_vl_model_takes_images_through_the_openai_chat_endpoint(vl_server):
    """An ``image_url`` part (a base64 data URL) in a chat message: the chat template places the
    image, and the answer is what the SDK samples from the same prompt with an image chunk there."""
    import openai
    from transformers import AutoTokenizer

    model_dir = vl_server.base_model
    ids = _vl_ids(model_dir)
    data = png((70, 90))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " here"}]}]
    with openai.OpenAI(base_url=vl_server.base_url + "/v1", api_key="tml-vl-oai", max_retries=0,
                       timeout=RESULT_TIMEOUT_S) as client:
        got = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=6, temperature=0.0,
                                             logprobs=True)
        # What the template renders, with the image where its placeholder is
        tok = AutoTokenizer.from_pretrained(model_dir)
        text_parts = [{"type": "text", "text": "what is"}, {"type": "image"}, {"type": "text", "text": " here"}]
        rendered = tok.encode(tok.apply_chat_template([{"role": "user", "content": text_parts}],
                                                      add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        at = rendered.index(ids["image_token_id"])
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=rendered[:at]),
                                          types.ImageChunk(data=data, format="png"),
                                          types.EncodedTextChunk(tokens=rendered[at + 1:])])
        sc = tinker.ServiceClient(base_url=vl_server.base_url, api_key="tml-vl-oai")
        want = sc.create_sampling_client(base_model=model_dir).result(timeout=RESULT_TIMEOUT_S).sample(
            prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(timeout=RESULT_TIMEOUT_S)
        seq = list(want.sequences[0].tokens)
        assert got.usage.prompt_tokens == len(rendered) - 1 + _image_tokens(model_dir, data)
        assert [e.logprob for e in got.choices[0].logprobs.content] == pytest.approx(
            list(want.sequences[0].logprobs)[:len(got.choices[0].logprobs.content)], abs=1e-5)
        eos = tok.eos_token_id
        assert got.choices[0].message.content == tok.decode([t for t in seq if t != eos])
        # Images are only ever taken inline, and checked as image chunks are
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_dir, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
        assert e.value.body["param"] == "messages[0].content[0].image_url.url"
        bad = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_dir, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}])
        assert e.value.body["param"] == "messages[0].content[0]", e.value.body
    sc.close("success").result(timeout=60)
