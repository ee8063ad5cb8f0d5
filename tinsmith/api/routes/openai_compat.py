"""OpenAI-compatible sampling: ``/completions``, ``/chat/completions`` and ``/models``.

Any OpenAI client samples a served base model, or a ``tinker://`` sampler checkpoint, by
setting its base URL and API key. The routes are served where the hosted Tinker service serves
them, at ``/oai/api/v1`` beside the Tinker API (base URL = the Tinker base URL + ``/oai/api/v1``),
and also at ``/v1``, where most OpenAI-compatible servers put them.

A request becomes the same ``sample`` job an SDK ``sample`` call does (same per-key limits,
same continuous batching with every other tenant, same snapshot handling); only the text
around it differs: prompts are tokenized, chat messages rendered with the model's own chat
template, and the sampled tokens decoded. An image-text model takes images in user messages as
``image_url`` parts holding base64 ``data:`` URLs (never fetched from elsewhere): the chat template
places each image, and the image becomes the model's image tokens as an SDK image chunk does.
Keys are accepted as ``Authorization: Bearer`` (what OpenAI clients send) or ``X-API-Key``, with
the same rules; errors use OpenAI's error JSON.

Streaming sends tokens as they are decoded: after each sampling slice (``--sampling-slice-s``)
the sampler reports every running sequence's tokens, and the new text goes out as an SSE chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tinsmith.api import openai_format as oai
from tinsmith.api.auth import Caller, key_from_headers
from tinsmith.api.codecs._images import check_image
from tinsmith.api.common import sampler_weights, state_of, submit
from tinsmith.api.images import fit_sample_input, no_images
from tinsmith.api.limits import limits_of, refuse_above
from tinsmith.api.request import ApiRoute, json_object
from tinsmith.api.request_rates import caller_found
from tinsmith.engine.scheduler import Outcome
from tinsmith.errors import AuthError, InvalidInputError, NotFoundError, TinsmithError, TooManyRequestsError
from tinsmith.server.operations import SampleArgs
from tinsmith.server.state import ServerState
from tinsmith.types import ImageInput, SampleInput, SamplingParams

if TYPE_CHECKING:
    from tinsmith.worker.service import BaseModel

log = logging.getLogger(__name__)

PREFIXES = ("/oai/api/v1", "/v1")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /completions (chat: up to the context)
WAIT_S = 30.0
NO_LOGPROB = -9999.0  # what OpenAI reports for a logprob of -inf (JSON has no infinity)


class OpenAIRoute(ApiRoute):
    """A route whose every refusal (auth, body, limits, sampling) has OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await handle(request)
            except TinsmithError as e:
                return error_response(e)

        return handler


def error_response(e: TinsmithError) -> JSONResponse:
    param = getattr(e, "param", None) or ("model" if isinstance(e, NotFoundError) else None)
    headers = None
    if isinstance(e, TooManyRequestsError):
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}
    return JSONResponse(oai.error_body(e.message, e.status, param), status_code=e.status, headers=headers)


def caller_of(request: Request) -> Caller:
    key = key_from_headers(request.headers)
    if not key:
        raise AuthError("missing API key: send it as 'Authorization: Bearer <key>' (or X-API-Key)")
    return caller_found(request.scope, key) or state_of(request).auth.authenticate(key)


# ----------------------------------------------------------------------------- which model
@dataclass
class Target:
    """What ``model`` names: a served base model, possibly with stored sampler weights on it."""

    base_model: str  # the name the sampler resolves
    base: BaseModel
    snapshot_key: str | None = None
    storage_path: str | None = None

    @property
    def tokenizer(self):
        return self.base.tokenizer

    def decode(self, ids) -> str:
        return self.base.tokenizer.decode(list(ids), skip_special_tokens=False)


async def resolve_target(state: ServerState, caller: Caller, model: str) -> Target:
    """``BASE``, ``tinker://RUN/sampler_weights/NAME``, or ``BASE;tinker://...`` (as the hosted service).

    A sampler path is checked exactly as ``create_sampling_session`` checks it: another key's
    private checkpoint is "not found".
    """
    base_name, sep, path = model.partition(";")
    if not sep:
        base_name, path = (None, model) if model.startswith("tinker://") else (model, "")
    if not path:
        try:
            base = state.worker.resolve_base(base_name or "")
        except InvalidInputError as e:
            raise NotFoundError(e.message.replace("base_model", "model", 1)) from None
        return Target(base_model=base_name or "", base=base)
    run_base, ck = await sampler_weights(state, caller, base_name, path, field="model")
    return Target(base_model=run_base, base=state.worker.resolve_base(run_base), snapshot_key=path,
                  storage_path=ck.storage_path)


def stop_strings(plan: oai.SamplingPlan, target: Target) -> list[str]:
    """The request's stop strings, plus the tokenizer's end-of-sequence text when the model's
    config does not already stop on it (chat models often end a turn with it)."""
    stops = list(plan.stop)
    tok = target.tokenizer
    eos, eos_id = getattr(tok, "eos_token", None), getattr(tok, "eos_token_id", None)
    if eos and eos_id not in target.base.config.eos_token_ids and eos not in stops:
        stops.append(eos)
    return stops


# ----------------------------------------------------------------------------- prompts
def encode_prompt(target: Target, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(target.tokenizer.encode(prompt))
    vocab = target.base.config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise oai.ParamError("prompt", f"prompt has token ids outside [0, {vocab}) (the model's vocabulary)")
    return list(prompt)


def render_chat(target: Target, model: str, messages: list[dict[str, Any]],
                images: Sequence[oai.ChatImage] = (), max_image_pixels: int = 0) -> tuple[list[int], list[ImageInput]]:
    """The model's chat template applied to the messages, with the assistant turn opened, and the
    messages' images, checked, each at the place the template gave it: where the template writes
    the model's image placeholder token, the image stands in the prompt (as an SDK image chunk
    between the text chunks), and :func:`fit_sample_input` turns it into the model's image tokens."""
    import jinja2

    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise oai.ParamError("model", f"model {model!r} has no chat template; use /completions with a prompt")
    vision = target.base.config.vision
    if images and vision is None:
        raise oai.ParamError(images[0].where, f"{images[0].where} is an image, but "
                                              f"{no_images(target.base_model, target.base.config)}")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        raise oai.ParamError("messages", f"the chat template of {model!r} refused these messages: {e}") from None
    tokens = list(tok.encode(text, add_special_tokens=False))
    if not images:
        return tokens, []
    assert vision is not None
    at = [i for i, t in enumerate(tokens) if t == vision.image_token_id]
    if len(at) != len(images):
        raise oai.ParamError("messages", f"the chat template of {model!r} placed {len(at)} image placeholder(s) "
                                         f"for the messages' {len(images)} image(s)")
    checked = []
    for k, (im, i) in enumerate(zip(images, at)):
        try:
            checked.append(check_image(im.data, im.fmt, None, position=i - k, where=im.where,
                                       max_pixels=max_image_pixels))
        except InvalidInputError as e:
            raise oai.ParamError(im.where, e.message) from None
    return [t for t in tokens if t != vision.image_token_id], checked


# ----------------------------------------------------------------------------- running samples
class TokenFeed:
    """Streams one job's running sequences: called on the worker thread after each sampling slice,
    it hands new tokens to the event loop's queue (only when a sequence grew)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, first_choice: int):
        self.loop, self.queue, self.first_choice = loop, queue, first_choice
        self.seen: dict[int, int] = {}

    def __call__(self, sample_idx: int, tokens: list[int]) -> None:
        if self.seen.get(sample_idx) == len(tokens):
            return
        self.seen[sample_idx] = len(tokens)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", self.first_choice + sample_idx, list(tokens)))


@dataclass
class Submitted:
    """One submitted ``sample`` job: its future, and where its choices go in the response."""

    request_id: str
    first_choice: int
    prompt_tokens: int


async def submit_samples(state: ServerState, caller: Caller, target: Target, plan: oai.SamplingPlan,
                         prompts: list[tuple[list[int], list[ImageInput]]], payload: bytes, stops: list[str],
                         prompt_param: str, feed: asyncio.Queue | None = None) -> list[Submitted]:
    """One ``sample`` job per prompt (its text tokens and images), each with ``n`` samples, checked
    against the server's limits."""
    limits = limits_of(state)
    ctx = target.base.config.max_position_embeddings
    try:
        refuse_above("n x the number of prompts", plan.n * len(prompts), limits.num_samples, "set by --max-num-samples")
    except InvalidInputError as e:
        raise oai.ParamError("n", e.message) from None
    inputs = []
    for text_tokens, images in prompts:
        inp = SampleInput(prompt=np.asarray(text_tokens, dtype=np.int64), num_samples=plan.n,
                          params=SamplingParams(max_tokens=1), prompt_images=images)
        fit_sample_input(inp, target.base_model, target.base.config, target.base.image_token_counter)
        tokens = inp.prompt
        max_tokens = plan.max_tokens
        if max_tokens is None:
            max_tokens = ctx - len(tokens) if limits.sample_tokens is None else min(ctx - len(tokens), limits.sample_tokens)
            if max_tokens < 1:
                raise oai.ParamError(prompt_param,
                                     f"the prompt ({len(tokens)} tokens) fills the model's context of {ctx} tokens")
        inp.params = SamplingParams(max_tokens=max_tokens, temperature=plan.temperature, top_p=plan.top_p,
                                    seed=plan.seed, stop=stops or None)
        inp.topk_sample_logprobs = plan.logprobs or 0
        try:
            limits.check_sample(inp, ctx)
        except InvalidInputError as e:
            raise oai.ParamError("max_tokens" if "max_tokens" in e.message else prompt_param, e.message) from None
        if len(tokens) + max_tokens > ctx:
            raise oai.ParamError("max_tokens", f"the prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) "
                                               f"exceeds the model's context of {ctx} tokens")
        inputs.append(inp)
    jobs = []
    loop = asyncio.get_running_loop()
    for i, inp in enumerate(inputs):
        first = i * plan.n
        ids = [f"openai:seq:{uuid.uuid4().hex}" for _ in range(plan.n)]
        progress = TokenFeed(loop, feed, first) if feed is not None else None
        args = SampleArgs(target.base_model, target.snapshot_key, target.storage_path, inp, ids, progress=progress)
        answer = await submit(state, caller, "sample", args, payload=payload, payload_type="json",
                              wire="sequences")
        jobs.append(Submitted(answer["request_id"], first, len(inp.prompt)))
    return jobs


async def outcome_of(state: ServerState, request_id: str) -> Outcome:
    """The job's outcome: pushed by the engine when it finishes, or read from the store after."""
    while True:
        out = await state.engine.wait(request_id, WAIT_S)
        if out is not None:
            return out
        if state.engine.pending(request_id):
            continue
        rec = await run_in_threadpool(state.store.get_result, request_id)
        if rec is None:
            raise TinsmithError(f"request {request_id!r} is no longer known to the server")
        if rec.status == "completed":
            return Outcome(result=rec.result, content_type=rec.result_content_type or "application/json")
        if rec.status == "failed":
            return Outcome(error=rec.error, category=rec.error_category or "server")
        await asyncio.sleep(0.05)


def raise_failure(out: Outcome) -> None:
    if out.error is not None:
        if out.category == "user":
            raise InvalidInputError(out.error)
        raise TinsmithError(out.error)


def _finite(values: list) -> list[float]:
    out = []
    for v in values:
        f = float(v)  # JSON results spell non-finite values as strings ("-Infinity")
        out.append(f if math.isfinite(f) else NO_LOGPROB)
    return out


def choices_of(out: Outcome, job: Submitted, target: Target, stops: list[str], top_k: int) -> list[oai.Choice]:
    raise_failure(out)
    result = json.loads(out.result or b"{}")
    choices = []
    for i, seq in enumerate(result["sequences"]):
        text, kept = oai.final_text(seq["tokens"], seq["stop_reason"], target.base.config.eos_token_ids, stops,
                                    target.decode)
        top = None
        if top_k:
            rows = seq.get("topk_logprobs") or []
            top = [[(int(t), _finite([lp])[0]) for t, lp in (row or [])] for row in rows[:kept]]
        choices.append(oai.Choice(index=job.first_choice + i, text=text, finish_reason=seq["stop_reason"],
                                  generated=len(seq["tokens"]), tokens=seq["tokens"][:kept],
                                  logprobs=_finite(seq["logprobs"][:kept]), top=top))
    return choices


# ----------------------------------------------------------------------------- streaming
def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def stream_events(state: ServerState, jobs: list[Submitted], queue: asyncio.Queue, target: Target,
                        plan: oai.SamplingPlan, stops: list[str], chat: bool) -> AsyncIterator[bytes]:
    """SSE chunks in OpenAI's format: text as it is decoded, a last chunk per choice with its
    finish_reason (and its logprobs, if asked for), usage if asked for, then ``[DONE]``."""
    rid = oai.new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    total = len(jobs) * plan.n

    def chunk(index: int, text: str | None, finish: str | None = None, logprobs: Any = None,
              role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": plan.model,
                        "choices": [choice]})
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return sse({"id": rid, "object": "text_completion", "created": created, "model": plan.model,
                    "choices": [choice]})

    waiters = [asyncio.create_task(_forward_outcome(state, j, queue)) for j in jobs]
    sent = [""] * total
    finished: set[int] = set()
    completion_tokens = 0
    try:
        if chat:
            for i in range(total):
                yield chunk(i, None, role=True)
        done_jobs = 0
        while done_jobs < len(jobs):
            kind, key, value = await queue.get()
            if kind == "tokens":
                if key in finished:
                    continue
                text = oai.streamable_text(value, stops, target.decode)
                if len(text) > len(sent[key]) and text.startswith(sent[key]):
                    yield chunk(key, text[len(sent[key]):])
                    sent[key] = text
                continue
            done_jobs += 1
            try:
                choices = choices_of(value, key, target, stops, plan.logprobs or 0)
            except TinsmithError as e:
                yield sse(oai.error_body(e.message, e.status))
                return
            for c in choices:
                finished.add(c.index)
                completion_tokens += c.generated
                rest = c.text[len(sent[c.index]):] if c.text.startswith(sent[c.index]) else ""
                logprobs = None
                if plan.logprobs is not None:
                    logprobs = oai.chat_logprobs(c, target.decode) if chat else oai.completion_logprobs(c, target.decode)
                yield chunk(c.index, rest, c.finish_reason, logprobs)
        if plan.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": plan.model, "choices": [],
                       "usage": oai.usage(sum(j.prompt_tokens for j in jobs), completion_tokens)})
        yield sse("[DONE]")
    finally:
        for w in waiters:  # the client went away: stop waiting (the samples finish regardless)
            w.cancel()


async def _forward_outcome(state: ServerState, job: Submitted, queue: asyncio.Queue) -> None:
    try:
        out = await outcome_of(state, job.request_id)
    except TinsmithError as e:
        out = Outcome.failure(e)
    queue.put_nowait(("done", job, out))


# ----------------------------------------------------------------------------- routes
async def run_request(request: Request, chat: bool) -> Response:
    state = state_of(request)
    caller = caller_of(request)
    body = await json_object(request)
    if chat:
        plan, messages, images = oai.chat_request(body)
    else:
        plan, raw_prompts = oai.completion_request(body)
        if plan.max_tokens is None:
            plan.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    target = await resolve_target(state, caller, plan.model)
    if chat:  # in a worker thread: images are decoded in full to check them
        prompts = [await run_in_threadpool(render_chat, target, plan.model, messages, images,
                                           limits_of(state).image_pixels)]
    else:
        prompts = await run_in_threadpool(lambda: [(encode_prompt(target, p), []) for p in raw_prompts])
    stops = stop_strings(plan, target)
    payload = await request.body()
    queue: asyncio.Queue | None = asyncio.Queue() if plan.stream else None
    jobs = await submit_samples(state, caller, target, plan, prompts, payload, stops,
                               "messages" if chat else "prompt", queue)
    if plan.stream:
        assert queue is not None
        return StreamingResponse(stream_events(state, jobs, queue, target, plan, stops, chat),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outcomes = await asyncio.gather(*(outcome_of(state, j.request_id) for j in jobs))
    choices = [c for j, out in zip(jobs, outcomes) for c in choices_of(out, j, target, stops, plan.logprobs or 0)]
    prompt_tokens = sum(j.prompt_tokens for j in jobs)
    build = oai.chat_response if chat else oai.completion_response
    rid = oai.new_id("chatcmpl" if chat else "cmpl")
    return JSONResponse(build(rid, plan.model, choices, plan.logprobs is not None, target.decode, prompt_tokens))


def model_card(model_id: str, owned_by: str, created: int = 0) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


async def list_models(request: Request) -> Response:
    """The served base models (and aliases), then the caller's own sampler checkpoints, newest first."""
    state = state_of(request)
    caller = caller_of(request)
    worker = state.worker
    cards = [model_card(name, "tinsmith") for name in [*worker.bases, *worker.aliases]]
    page = await run_in_threadpool(state.store.list_user_checkpoints, caller.owner, 1000, 0)
    cards += [model_card(ck.tinker_path, ck.run_id, int(ck.created_at.timestamp()))
              for ck in page.items if ck.kind == "sampler_weights"]
    return JSONResponse({"object": "list", "data": cards})


async def get_model(model: str, request: Request) -> Response:
    state = state_of(request)
    caller = caller_of(request)
    target = await resolve_target(state, caller, model)
    owner = "tinsmith" if target.snapshot_key is None else target.snapshot_key[len("tinker://"):].split("/")[0]
    return JSONResponse(model_card(model, owner))


async def completions(request: Request) -> Response:
    return await run_request(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await run_request(request, chat=True)


def _router(prefix: str) -> APIRouter:
    router = APIRouter(prefix=prefix, route_class=OpenAIRoute)
    router.add_api_route("/completions", completions, methods=["POST"])
    router.add_api_route("/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/models/{model:path}", get_model, methods=["GET"])
    return router


ROUTERS = [_router(p) for p in PREFIXES]
