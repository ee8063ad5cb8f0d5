"""The OpenAI wire rules: parameters checked and named, text cut at stops, streamed text stable."""

from __future__ import annotations

import base64

import pytest

from tinsmith.api import openai_format as oai

ALPHABET = "abcdefghijklmnopqrstuvwxyz .!<>|"
EOS = 99


def decode(ids) -> str:
    """A character-per-token tokenizer; token 99 is the end of sequence, 98 half a character."""
    return "".join("<eos>" if t == EOS else "\ufffd" if t == 98 else ALPHABET[t] for t in ids)


def ids(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def test_final_text_drops_eos_and_everything_from_the_stop_string_on():
    assert oai.final_text(ids("hello") + [EOS], "stop", [EOS], [], decode) == ("hello", 5)
    assert oai.final_text(ids("hello"), "length", [EOS], ["ll"], decode) == ("hello", 5)  # not stopped by it
    text, kept = oai.final_text(ids("say hi. more"), "stop", [EOS], ["hi.", "zz"], decode)
    assert (text, kept) == ("say ", 4)


def test_streamable_text_holds_back_what_may_still_change():
    assert oai.streamable_text(ids("say h"), ["hi."], decode) == "say "  # may become the stop string
    assert oai.streamable_text(ids("say hx"), ["hi."], decode) == "say hx"
    assert oai.streamable_text(ids("ab") + [98], [], decode) == "ab"  # incomplete character
    assert oai.streamable_text(ids("say hi. x"), ["hi."], decode) == "say "


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 3}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stop": [1, 2]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"prompt": "x"}, "model"),
])
def test_completion_parameters_are_checked_by_name(body, param):
    with pytest.raises(oai.ParamError) as e:
        oai.completion_request(body)
    assert e.value.param == param and param in e.value.message


def test_inert_parameters_at_their_defaults_are_accepted():
    plan, prompts = oai.completion_request({"model": "m", "prompt": ["a", [5, 6]], "echo": False, "best_of": 1,
                                            "presence_penalty": 0, "user": "me", "stop": "x", "n": 2})
    assert prompts == ["a", [5, 6]] and plan.stop == ["x"] and plan.n == 2 and plan.logprobs is None


def test_chat_parameters():
    plan, messages, images = oai.chat_request({
        "model": "m", "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 2, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    })
    assert (plan.max_tokens, plan.logprobs, plan.include_usage) == (9, 2, True)
    assert messages == [{"role": "user", "content": "ab"}] and images == []
    for body, param in [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
          "max_completion_tokens": 4}, "max_completion_tokens"),
    ]:
        with pytest.raises(oai.ParamError) as e:
            oai.chat_request(body)
        assert e.value.param == param


PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG not checked here").decode()


def test_image_parts_become_template_parts_and_images_in_order():
    _, messages, images = oai.chat_request({"model": "m", "messages": [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": PNG_URL}},
                                     {"type": "image_url", "image_url": {"url": PNG_URL.replace("png", "jpeg", 1),
                                                                         "detail": "low"}}]},
    ]})
    assert messages[1] == {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]}
    assert [(im.fmt, im.where) for im in images] == [("png", "messages[1].content[1]"), ("jpeg", "messages[1].content[2]")]
    assert images[0].data == b"\x89PNG not checked here"


@pytest.mark.parametrize("part, param, words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "messages[0].content[0].image_url.url",
     "does not fetch images by URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lG"}}, "messages[0].content[0].image_url.url",
     "PNG, JPEG or WebP"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "messages[0].content[0].image_url.url",
     "does not decode"),
    ({"type": "image_url", "image_url": 7}, "messages[0].content[0].image_url", "must be a string"),
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]", "only text parts"),
])
def test_bad_image_parts_are_named(part, param, words):
    with pytest.raises(oai.ParamError) as e:
        oai.chat_request({"model": "m", "messages": [{"role": "user", "content": [part]}]})
    assert e.value.param == param and words in e.value.message


def test_images_only_in_user_messages():
    with pytest.raises(oai.ParamError) as e:
        oai.chat_request({"model": "m", "messages": [
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]}]})
    assert e.value.param == "messages[0].content[0]"


def test_error_body_has_openais_shape():
    assert oai.error_body("bad", 400, "n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert oai.error_body("who?", 401)["error"]["type"] == "authentication_error"


def test_sequences_json_carries_the_sampled_top_k():
    import json

    from tests.api.test_codecs import _sample_result
    from tinsmith.api.codecs import encode_sample_sequences_json

    out = json.loads(json.dumps(encode_sample_sequences_json(_sample_result()), allow_nan=False))
    first, second = out["sequences"]
    assert first["tokens"] == [5, 8, 4] and first["stop_reason"] == "stop"
    assert [[t for t, _ in row] for row in first["topk_logprobs"]] == [[5, 6, 7], [8, 9], [4]]  # absent ones dropped
    assert "topk_logprobs" not in second and second["logprobs"][-1] == "-Infinity"


def test_the_key_comes_from_x_api_key_or_a_bearer_token():
    from tinsmith.api.auth import key_from_headers

    assert key_from_headers({"x-api-key": "tml-a", "authorization": "Bearer tml-b"}) == "tml-a"
    assert key_from_headers({"authorization": "Bearer tml-b"}) == "tml-b"
    assert key_from_headers({"authorization": "bearer  tml-c "}) == "tml-c"
    assert key_from_headers({"authorization": "Basic dXNlcg=="}) is None
    assert key_from_headers({"authorization": "Bearer "}) is None
    assert key_from_headers({}) is None
