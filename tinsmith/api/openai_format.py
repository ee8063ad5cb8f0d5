"""The OpenAI wire format: request bodies checked into one sampling plan, and responses built.

Pure functions of JSON and token ids (no HTTP, no server state), so the rules are in one place:

* every parameter is either used, accepted at a value that changes nothing (``n``-like defaults,
  zero penalties, ``echo: false``), or refused with a 400 naming it; an unknown one is refused
  too, never silently ignored;
* text comes from the model's tokenizer; a stop string ends the text *before* it and the
  end-of-sequence token is never part of it (OpenAI's semantics; the token-level Tinker API
  keeps both). Special tokens the model writes otherwise stay in the text;
* ``finish_reason`` is ``"stop"`` (a stop string or token) or ``"length"`` (``max_tokens``).
"""

from __future__ import annotations

import base64
import binascii
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinsmith.errors import InvalidInputError

MAX_STOP_STRINGS = 16  # as many as anyone needs; each one is watched at every decoded token
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (5 for completions; more does no harm here)

Decode = Callable[[Sequence[int]], str]


class ParamError(InvalidInputError):
    """A 400 about one request parameter; OpenAI's error body names it in ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error JSON (the ``openai`` client raises it as ``BadRequestError`` etc.)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    code = {401: "invalid_api_key", 404: "model_not_found"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----------------------------------------------------------------------------- requests
@dataclass
class SamplingPlan:
    """What one OpenAI request asks for, in the sampler's terms."""

    model: str
    n: int = 1
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled tokens' plus the top k
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


# Parameters accepted only at a value that changes nothing: name -> is that value harmless?
_INERT: dict[str, Callable[[Any], bool]] = {
    "user": lambda v: v is None or isinstance(v, str),
    "frequency_penalty": lambda v: v in (None, 0),
    "presence_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "metadata": lambda v: v is None or isinstance(v, dict),
    "store": lambda v: v in (None, False),
    "parallel_tool_calls": lambda v: v is None,
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "stream_options": lambda v: True,  # read below
}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "logprobs"}
_COMPLETIONS = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


def _check_known(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name in known:
            continue
        inert = _INERT.get(name)
        if inert is None:
            raise ParamError(name, f"parameter {name!r} is not supported by this server")
        if not inert(value):
            raise ParamError(name, f"parameter {name!r} is not supported by this server (only its default is accepted)")


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParamError(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ParamError(name, f"{name} must be {bound}, got {v}")
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ParamError(name, f"{name} must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise ParamError(name, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ParamError(name, f"{name} must be true or false, got {v!r}")
    return v


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ParamError("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted")
    return [s for s in stops if s]


def _common_plan(body: dict) -> SamplingPlan:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ParamError("model", "model is required: a served base model's name or a tinker:// sampler path")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise ParamError("stream_options", "stream_options takes {\"include_usage\": bool}, with stream: true")
    return SamplingPlan(
        model=model,
        n=_int(body, "n", 1, None) or 1,
        max_tokens=_int(body, "max_tokens", 1),
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_int(body, "seed", -(1 << 63), (1 << 64) - 1),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def completion_request(body: dict) -> tuple[SamplingPlan, list[str | list[int]]]:
    """``/completions``: the plan and the prompts (text, or token ids), one or several."""
    _check_known(body, _COMPLETIONS)
    plan = _common_plan(body)
    plan.logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ParamError("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either")
    if any(len(p) == 0 for p in prompts):
        raise ParamError("prompt", "prompt must not be empty")
    return plan, prompts


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatImage:
    """An ``image_url`` part of a chat message: the image's bytes and format, and where it was."""

    data: bytes
    fmt: str
    where: str


# A data URL's media type -> the image chunk formats the server checks (tinsmith.api.codecs._images).
_IMAGE_MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}


def chat_request(body: dict) -> tuple[SamplingPlan, list[dict[str, Any]], list[ChatImage]]:
    """``/chat/completions``: the plan, the messages as the chat template takes them (``content``
    a string, or, for a message with images, a list of ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}`` parts), and the messages' images in order."""
    _check_known(body, _CHAT)
    plan = _common_plan(body)
    limit = _int(body, "max_completion_tokens", 1)
    if limit is not None:
        if plan.max_tokens is not None and plan.max_tokens != limit:
            raise ParamError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; pass one")
        plan.max_tokens = limit
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _bool(body, "logprobs"):
        plan.logprobs = top or 0
    elif top:
        raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "messages must be a non-empty list")
    images: list[ChatImage] = []
    return plan, [_message(m, i, images) for i, m in enumerate(messages)], images


def _message(m: Any, i: int, images: list[ChatImage]) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ParamError(where, f"{where} must be an object with role and content")
    role = m.get("role")
    if role not in _ROLES:
        raise ParamError(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    for name in m:
        if name not in ("role", "content", "name"):
            raise ParamError(f"{where}.{name}", f"{where}.{name} is not supported by this server")
    content = m.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if isinstance(content, list):
        parts: list[dict[str, str]] = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and role == "user":
                images.append(_image_part(part.get("image_url"), pwhere))
                parts.append({"type": "image"})
            else:
                raise ParamError(pwhere, f"{pwhere}: only text parts ({{\"type\": \"text\", \"text\": ...}}) and, in "
                                         "user messages, image parts ({\"type\": \"image_url\", \"image_url\": "
                                         "{\"url\": \"data:image/png;base64,...\"}}) are supported")
        if any(p["type"] == "image" for p in parts):
            return {"role": role, "content": parts}
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of text and image parts")


def _image_part(value: Any, where: str) -> ChatImage:
    """An ``image_url`` part's image: inline (a base64 ``data:`` URL), never fetched from elsewhere."""
    url = value.get("url") if isinstance(value, dict) else value
    uwhere = f"{where}.image_url.url" if isinstance(value, dict) else f"{where}.image_url"
    if not isinstance(url, str):
        raise ParamError(uwhere, f"{uwhere} must be a string (a data: URL holding the image)")
    if not url.startswith("data:"):
        raise ParamError(uwhere, f"{uwhere}: this server does not fetch images by URL; send the image's bytes "
                                 "inline as a data URL (data:image/png;base64,...)")
    head, sep, payload = url[len("data:"):].partition(",")
    media, _, encoding = head.partition(";")
    fmt = _IMAGE_MEDIA_TYPES.get(media.strip().lower())
    if not sep or encoding.strip().lower() != "base64" or fmt is None:
        raise ParamError(uwhere, f"{uwhere} must be a base64 data URL of a PNG, JPEG or WebP image "
                                 "(data:image/png;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParamError(uwhere, f"{uwhere}: the image's base64 does not decode") from None
    return ChatImage(data, fmt, where)


# ----------------------------------------------------------------------------- text of a sequence
def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def final_text(tokens: Sequence[int], stop_reason: str, eos_ids: Sequence[int], stops: Sequence[str],
               decode: Decode) -> tuple[str, int]:
    """The text of a finished sequence and how many of its tokens that text covers.

    A sequence stopped by an end-of-sequence token loses that token; one stopped by a stop
    string loses the string and whatever follows it (the rest of the token that completed it).
    """
    toks = list(tokens)
    if stop_reason == "stop" and toks and toks[-1] in eos_ids:
        toks.pop()
    text = decode(toks)
    cut = _first_stop(text, stops) if stop_reason == "stop" else None
    if cut is None:
        return text, len(toks)
    text = text[:cut]
    kept = len(toks)
    while kept > 0 and len(decode(toks[: kept - 1])) >= cut:  # a stop string spans a few tokens at most
        kept -= 1
    return text, kept


def streamable_text(tokens: Sequence[int], stops: Sequence[str], decode: Decode) -> str:
    """The part of a running sequence's text that no later token can change.

    Held back: a trailing incomplete UTF-8 character, and a tail that might still grow into a
    stop string (which the final text will not contain).
    """
    text = decode(tokens)
    cut = _first_stop(text, stops)
    if cut is not None:
        return text[:cut]
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


# ----------------------------------------------------------------------------- responses
@dataclass
class Choice:
    """One finished sequence, as the response reports it."""

    index: int
    text: str
    finish_reason: str
    generated: int  # tokens sampled (the usage count), including a final stop token
    tokens: list[int]  # the tokens the text covers
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per token: the k most likely (token, logprob)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(c: Choice, decode: Decode, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object: tokens, their logprobs, top alternatives, offsets."""
    strings = [decode([t]) for t in c.tokens]
    offsets, at = [], offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    top = None if c.top is None else [_by_text(row, decode) for row in c.top]
    return {"tokens": strings, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}


def _by_text(row: list[tuple[int, float]], decode: Decode) -> dict[str, float]:
    """Top alternatives keyed by their text; tokens that decode alike (partial UTF-8) keep the best."""
    out: dict[str, float] = {}
    for t, lp in row:
        s = decode([t])
        out[s] = max(lp, out.get(s, lp))
    return out


def chat_logprobs(c: Choice, decode: Decode) -> dict:
    """The chat ``logprobs`` object: one entry per token, with its top alternatives."""
    def entry(t: int, lp: float) -> dict:
        s = decode([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(c.tokens, c.logprobs)):
        e = entry(t, lp)
        e["top_logprobs"] = [] if c.top is None else [entry(a, alp) for a, alp in c.top[i]]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_response(rid: str, model: str, choices: list[Choice], want_logprobs: bool, decode: Decode,
                        prompt_tokens: int) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": completion_logprobs(c, decode) if want_logprobs else None} for c in choices],
        "usage": usage(prompt_tokens, sum(c.generated for c in choices)),
    }


def chat_response(rid: str, model: str, choices: list[Choice], want_logprobs: bool, decode: Decode,
                  prompt_tokens: int) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason,
                     "logprobs": chat_logprobs(c, decode) if want_logprobs else None} for c in choices],
        "usage": usage(prompt_tokens, sum(c.generated for c in choices)),
    }
