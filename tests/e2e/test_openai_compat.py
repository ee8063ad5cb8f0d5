"""The OpenAI-compatible endpoints, driven by the official, unmodified ``openai`` client.

The same server also trains through the ``tinker`` SDK: a sampler checkpoint saved there is
sampled by ``tinker://`` path, and its greedy text must equal the SDK's greedy sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from tinker import types
from transformers import AutoTokenizer

from tests.e2e.conftest import KEY_A, KEY_B, VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, lora_client, repeated_pattern_batch, train_steps

pytestmark = pytest.mark.e2e

PROMPT = "the small model learns to answer"
MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is two plus two?"}]


def client(srv, api_key: str = "tml-e2e-local", prefix: str = "/oai/api/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + prefix, api_key=api_key, max_retries=0, timeout=RESULT_TIMEOUT_S)


@pytest.fixture
def oai(server) -> Iterator[openai.OpenAI]:
    with client(server) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def ascii_piece(text: str, start: int = 2) -> str:
    """Two plain characters of ``text`` from ``start`` on (a stop string the tokenizer cannot split oddly)."""
    for i in range(start, len(text) - 1):
        piece = text[i:i + 2]
        if piece.isascii() and piece.isprintable():
            return piece
    raise AssertionError(f"no plain two-character piece in {text!r}")


def test_models_lists_the_served_base_model_on_both_paths(server, oai, base_model):
    assert base_model in [m.id for m in oai.models.list()]
    with client(server, prefix="/v1") as plain:
        assert base_model in [m.id for m in plain.models.list()]
        assert plain.models.retrieve(base_model).id == base_model


def test_completion_greedy_with_logprobs_usage_and_n(oai, base_model, tokenizer):
    a = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    b = oai.completions.create(model=base_model, prompt=tokenizer.encode(PROMPT), max_tokens=6, temperature=0)
    (choice,) = a.choices
    assert choice.finish_reason == "length" and choice.text == b.choices[0].text
    assert a.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and a.usage.completion_tokens == 6
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 6
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy: the best one

    several = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    again = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert [c.text for c in several.choices] == [c.text for c in again.choices]
    assert several.usage.completion_tokens == 15


def test_completion_stop_string_ends_the_text_before_it(oai, base_model):
    full = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0]
    stop = ascii_piece(full.text)
    cut = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=24, temperature=0,
                                 stop=[stop, "never-appears"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    streamed = list(oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=24, temperature=0,
                                           stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text  # no part of the stop string leaked out
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_several_prompts_in_one_completion_request(oai, base_model, tokenizer):
    other = tokenizer.encode("one two three")
    r = oai.completions.create(model=base_model, prompt=[PROMPT, other], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [oai.completions.create(model=base_model, prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in (PROMPT, other)]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(other)
    streamed = ["", "", "", ""]
    for chunk in oai.completions.create(model=base_model, prompt=[PROMPT, other], max_tokens=5, temperature=0, n=2,
                                        stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in r.choices]


def test_chat_completion_uses_the_chat_template(oai, base_model, tokenizer):
    r = oai.chat.completions.create(model=base_model, messages=MESSAGES, max_completion_tokens=7, temperature=0,
                                    logprobs=True, top_logprobs=3)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert r.usage.completion_tokens == 7
    entries = choice.logprobs.content
    assert len(entries) == 7 and "".join(e.token for e in entries) == choice.message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
               for e in entries)
    # the same tokens through /completions, rendered by hand, give the same text
    raw = oai.completions.create(model=base_model, prompt=rendered, max_tokens=7, temperature=0)
    assert raw.choices[0].text == choice.message.content


def test_streaming_completion_and_chat_match_the_whole_answer(oai, base_model):
    whole = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=40, temperature=0).choices[0]
    chunks = list(oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=40, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    whole_chat = oai.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=30, temperature=0)
    stream = oai.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=30, temperature=0, n=2,
                                         stream=True, stream_options={"include_usage": True})
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (c,) = chunk.choices
        texts[c.index] += c.delta.content or ""
        finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [whole_chat.choices[0].message.content] * 2
    assert finish == [whole_chat.choices[0].finish_reason] * 2
    assert usage.completion_tokens == 2 * whole_chat.usage.completion_tokens
    assert usage.prompt_tokens == whole_chat.usage.prompt_tokens


def test_bad_parameters_get_a_400_naming_them(oai, base_model):
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(temperature=3.5), "temperature"),
        (dict(n=0), "n"),
        (dict(n=100_000), "n"),
        (dict(max_tokens=100_000), "max_tokens"),
        (dict(extra_body={"mirostat": 2}), "mirostat"),
        (dict(top_logprobs=2), "top_logprobs"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{"model": base_model, "messages": MESSAGES, "max_tokens": 4, **kwargs})
        assert e.value.body["param"] == param and param in e.value.body["message"], (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=base_model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"  # never fetched
    with pytest.raises(openai.BadRequestError) as e:  # an inline image, to a text-only model
        oai.chat.completions.create(model=base_model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {
                "url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert e.value.body["param"] == "messages[0].content[1]" and "text-only model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=base_model, prompt=[VOCAB + 5], max_tokens=4)
    assert e.value.body["param"] == "prompt" and "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert e.value.body["param"] == "model"


def test_sampler_path_matches_the_sdk_and_is_private_to_its_key(restricted_server, service_client, base_model,
                                                                tokenizer):
    sc = service_client(restricted_server, KEY_A)
    tc = lora_client(sc, base_model, rank=4, seed=0)
    train_steps(tc, repeated_pattern_batch(seed=5, n_seqs=4, seq_len=24, vocab=VOCAB), steps=3, lr=5e-2)
    path = tc.save_weights_for_sampler("oai").result(timeout=RESULT_TIMEOUT_S).path
    prompt = tokenizer.encode(PROMPT)
    sdk = sc.create_sampling_client(model_path=path).result(timeout=RESULT_TIMEOUT_S).sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=12, temperature=0.0),
    ).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    sdk_tokens = list(sdk.tokens)
    if sdk.stop_reason == "stop" and sdk_tokens[-1] == tokenizer.eos_token_id:
        sdk_tokens.pop()

    with client(restricted_server, KEY_A) as a, client(restricted_server, KEY_B) as b:
        assert path in [m.id for m in a.models.list()]
        assert path not in [m.id for m in b.models.list()]
        assert a.models.retrieve(path).id == path
        r = a.completions.create(model=path, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
        (choice,) = r.choices
        assert choice.text == tokenizer.decode(sdk_tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(list(sdk.logprobs)[: len(sdk_tokens)], abs=1e-4)
        base = a.completions.create(model=base_model, prompt=prompt, max_tokens=12, temperature=0)
        assert base.choices[0].text != choice.text  # the adapter is really used
        # the hosted service's "<base model>;<path>" form
        assert a.completions.create(model=f"{base_model};{path}", prompt=prompt, max_tokens=12,
                                    temperature=0).choices[0].text == choice.text
        for call in (lambda: b.completions.create(model=path, prompt=prompt, max_tokens=4),
                     lambda: b.chat.completions.create(model=path, messages=MESSAGES, max_tokens=4),
                     lambda: b.models.retrieve(path)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert path in e.value.body["message"]

    with client(restricted_server, "tml-not-listed") as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    with httpx.Client(base_url=restricted_server.base_url, timeout=RESULT_TIMEOUT_S) as http:
        assert http.get("/oai/api/v1/models").status_code == 401
        r = http.get("/v1/models", headers={"X-API-Key": KEY_A})  # the SDK's header works here too
        assert r.status_code == 200 and path in [m["id"] for m in r.json()["data"]]


def test_body_limit_applies(restricted_server, base_model):
    # a body above --max-body-bytes is refused before anything is parsed, as on every route
    with client(restricted_server, KEY_A) as a:
        with pytest.raises(openai.APIStatusError) as e:
            a.completions.create(model=base_model, prompt="x " * 10_000, max_tokens=2)
        assert e.value.status_code == 413

