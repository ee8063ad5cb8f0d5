"""Hostile input on every route of the app: a 4xx naming the field, before anything is stored.

The real application (routes, store, engine and worker on a tiny model) runs in-process behind
FastAPI's TestClient, on SQLite and on PostgreSQL, where NUL characters and wide integers fail
inside the database if they get that far. Every route of the app has a valid request in
:func:`valid_calls` (checked first), and each sweep below mutates those requests one field at a
time, so a route added later is swept too. After every test no answer was a 500, no accepted
request's future failed as a server error, and the log holds no traceback.
"""

from __future__ import annotations

import re

import copy
import itertools
import json
import logging
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
import sqlalchemy as sa
import zstandard
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from tinker import types as T
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.client_config_response import ClientConfigResponse

from tests.e2e.helpers import assert_no_internal_errors
from tinsmith.api.app import create_app
from tinsmith.api.routes import ROUTERS
from tinsmith.server.config import ServerConfig
from tinsmith.server.state import ServerState
from tinsmith.store.tables import RequestTable
from tinsmith.worker.service import RuntimeOptions

BODY_LIMIT = 1 << 20  # --max-body-bytes of the apps under test
CONTEXT = 512  # the tiny model's context length
NUL, SURROGATE = "\x00", "\ud800"
WIDE_INTS = (1 << 64, -(1 << 63) - 1)  # just outside int64 (and uint64), each side
KEY = {"X-API-Key": "tml-hostile"}
JSON_TYPE = {"Content-Type": "application/json"}
AGE_RECIPIENT = "age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"  # the age spec's example key


# --------------------------------------------------------------------------------------- the app
class App:
    """A running app and the ids a valid request of each route needs."""

    def __init__(self, client: TestClient, state: ServerState, base_model: str) -> None:
        self.client, self.state, self.base_model = client, state, base_model
        self.accepted: list[str] = []  # request ids answered 2xx, to check their futures
        self._seq = itertools.count(1)
        self._names = itertools.count()
        self.session_id = self.ok("POST", "/api/v1/create_session", {"tags": ["hostile"]})["session_id"]
        self.model_id = self.new_model()
        self.sampler_id = self.ok("POST", "/api/v1/create_sampling_session", {
            "session_id": self.session_id, "sampling_session_seq_id": self.number(), "base_model": base_model,
        })["sampling_session_id"]
        self.weights = self.save("save_weights", "w")
        self.sampler_weights = self.save("save_weights_for_sampler", "s")
        self.external = self.save("save_weights_external", "e")

    # ---- plumbing
    def send(self, method: str, url: str, body: Any = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None, query: dict[str, Any] | None = None):
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        r = self.client.request(method, url, content=content, params=query,
                                headers={**KEY, **JSON_TYPE, **(headers or {})})
        if r.status_code < 300 and "json" in r.headers.get("content-type", ""):
            rid = r.json().get("request_id") if isinstance(r.json(), dict) else None
            if rid and url != "/api/v1/retrieve_future":
                self.accepted.append(rid)
        return r

    def ok(self, method: str, url: str, body: Any = None) -> dict:
        r = self.send(method, url, body)
        assert r.status_code == 200, (url, r.status_code, r.text)
        return r.json()

    def outcome(self, request_id: str) -> tuple[str | None, str | None]:
        """Wait for a future: ``(None, None)`` when it succeeded, else ``(error, category)``."""
        for _ in range(600):
            r = self.client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=KEY)
            assert r.status_code == 200, r.text
            if "json" not in r.headers["content-type"]:
                return None, None  # a protobuf result
            out = r.json()
            if out.get("type") != "try_again":
                return out.get("error"), out.get("category")
        raise AssertionError(f"future {request_id} did not finish")

    def done(self, answer: dict) -> dict:
        error, category = self.outcome(answer["request_id"])
        assert error is None, (error, category)
        return answer

    def number(self) -> int:
        return next(self._seq)

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self._names)}"

    # ---- things valid requests refer to
    def new_model(self) -> str:
        return self.done(self.ok("POST", "/api/v1/create_model", {
            "session_id": self.session_id, "model_seq_id": self.number(), "base_model": self.base_model,
            "lora_config": {"rank": 4, "seed": 1},
        }))["model_id"]

    def save(self, route: str, prefix: str) -> str:
        name = self.name(prefix)
        self.done(self.ok("POST", f"/api/v1/{route}", {"model_id": self.model_id, "path": name,
                                                        "seq_id": self.number()}))
        return name

    def tinker_path(self, kind: str, name: str) -> str:
        return f"tinker://{self.model_id}/{kind}/{name}"

    def requests_stored(self) -> int:
        with self.state.store.engine.connect() as c:
            return c.execute(sa.select(sa.func.count()).select_from(RequestTable)).scalar_one()


def make_app(model_dir: Path, data_dir: Path, database_url: str | None = None, **options) -> Iterator[App]:
    config = ServerConfig(base_model=[str(model_dir)], data_dir=str(data_dir), database_url=database_url,
                          max_body_bytes=BODY_LIMIT, long_poll_seconds=5.0, **options)
    state = ServerState.build(config)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield App(client, state, str(model_dir))


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def app(request, qwen3_dir, tmp_path_factory) -> Iterator[App]:
    data_dir = tmp_path_factory.mktemp(f"hostile-{request.param}")
    if request.param == "sqlite":
        yield from make_app(qwen3_dir, data_dir)
        return
    server = request.getfixturevalue("postgres")
    schema = server.new_schema()
    try:
        yield from make_app(qwen3_dir, data_dir, server.url_for(schema))
    finally:
        server.drop_schema(schema)


@pytest.fixture(autouse=True)
def _no_server_errors(request, caplog) -> Iterator[None]:
    """After each test: every accepted request's future ended without a server error, and the
    log holds no traceback or internal error."""
    yield
    for name in ("app", "small_app"):
        if name in request.fixturenames:
            app: App = request.getfixturevalue(name)
            pending, app.accepted = app.accepted, []
            failures = [(rid, *app.outcome(rid)) for rid in pending]
            assert not [f for f in failures if f[2] == "server"], failures
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")  # with tracebacks
    # The server's records only: the SDK in this process logs too (its telemetry thread warns, with
    # a traceback, when it cannot reach an earlier test's server, which has stopped).
    server = [r for r in caplog.get_records("call") if r.name != "tinker" and not r.name.startswith("tinker.")]
    assert_no_internal_errors("\n".join(formatter.format(r) for r in server))


sqlite_only = pytest.mark.parametrize("app", ["sqlite"], indirect=True)


# ------------------------------------------------------------------------------- valid requests
@dataclass
class Call:
    """One request: the route it targets, its path and query parameters and its JSON body."""

    method: str
    route: str
    path: dict[str, str] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)
    body: Any = None  # None: the route reads no body

    def url(self, **path: str) -> str:
        values = {**self.path, **path}
        template = re.sub(r"\{(\w+):\w+\}", r"{\1}", self.route)  # {model:path} -> {model}
        return template.format(**{k: quote(str(v), safe="") for k, v in values.items()})

    def send(self, app: App, body: Any = None, **kw):
        return app.send(self.method, kw.pop("url", self.url()), self.body if body is None else body,
                        query=kw.pop("query", self.query), **kw)


def datum_json(tokens: list[int]) -> dict:
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [len(tokens) - 1]},
                               "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"}}}


def sample_body(app: App, **over: Any) -> dict:
    return {"sampling_session_id": app.sampler_id, "seq_id": app.number(), "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 3,
                                "stop": ["x"]},
            "topk_prompt_logprobs": 0, "type": "sample", **over}


def valid_calls(app: App) -> list[Call]:
    """A valid request for every route of the app (resources a request would consume are fresh)."""
    s, m, b = app.session_id, app.model_id, app.base_model
    meta = {"note": "n", "level": 1, "ratio": 0.5}
    run_ck = {"run_id": m, "kind": "weights"}
    fresh_public = app.save("save_weights", "pub")
    app.ok("POST", f"/api/v1/training_runs/{quote(m, safe='')}/checkpoints/weights/{fresh_public}/publish")
    urls = app.ok("GET", f"/api/v1/training_runs/{quote(m, safe='')}/checkpoints/external_weights/"
                         f"{app.external}/external_weights_urls")["urls"]
    download = urlsplit(next(iter(urls.values()))).path.split("/")[-5:]
    files = app.ok("GET", f"/dashboard/api/runs/{quote(m, safe='')}/checkpoints/weights/{app.weights}/files")["urls"]
    download_kind = urlsplit(next(iter(files.values()))).path.split("/")[-6:]
    trace = urlsplit(app.ok("GET", f"/api/v1/sessions/{s}/trace_export")["url"]).path.split("/")[-3:]
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    return [
        Call("POST", "/api/v1/client/config"),  # the SDK sends its version; the route reads no body
        Call("POST", "/api/v1/client/dynamic_config"),
        Call("GET", "/api/v1/healthz"),
        Call("GET", "/metrics"),
        Call("GET", "/api/v1/get_server_capabilities"),
        Call("POST", "/api/v1/telemetry"),
        Call("POST", "/api/v1/create_session", body={"tags": ["t"], "user_metadata": meta, "sdk_version": "0.38.0",
                                                     "project_id": "p", "display_name": "d"}),
        Call("POST", "/api/v1/session_heartbeat", body={"session_id": s}),
        Call("POST", "/api/v1/sessions/{session_id}/finish",
             {"session_id": app.ok("POST", "/api/v1/create_session", {})["session_id"]},
             body={"reason": {"type": "success"}, "detail": "done"}),
        Call("GET", "/api/v1/sessions", query={"limit": 5, "offset": 0, "access_scope": "owned"}),
        Call("GET", "/api/v1/sessions/{session_id}", {"session_id": s}),
        Call("POST", "/api/v1/create_model", body={
            "session_id": s, "model_seq_id": app.number(), "base_model": b, "user_metadata": meta,
            "lora_config": {"rank": 4, "seed": 1, "train_mlp": True}, "optimizer_config": {"type": "adamw"}}),
        Call("POST", "/api/v1/get_info", body={"model_id": m, "type": "get_info"}),
        Call("POST", "/api/v1/forward_backward", body={
            "forward_backward_input": {"data": [datum_json([1, 2, 3, 4])], "loss_fn": "cross_entropy",
                                       "loss_fn_config": {"k": "v"}},
            "model_id": m, "seq_id": app.number()}),
        Call("POST", "/api/v1/forward", body={
            "forward_input": {"data": [datum_json([1, 2, 3])], "loss_fn": "cross_entropy"},
            "model_id": m, "seq_id": app.number()}),
        Call("POST", "/api/v1/create_custom_loss", body={
            "session_id": s, "custom_loss_seq_id": app.number(), "name": "nll", "type": "create_custom_loss",
            "inputs": [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}],
            "graph": {"format": 1, "nodes": [
                {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
                {"op": "placeholder", "name": "weights", "target": "weights", "args": [], "kwargs": {}},
                {"op": "call_function", "name": "mul", "target": "operator.mul",
                 "args": [{"ref": "logprobs"}, {"ref": "weights"}], "kwargs": {}},
                {"op": "call_method", "name": "sum_1", "target": "sum", "args": [{"ref": "mul"}],
                 "kwargs": {"dim": None}},
                {"op": "output", "name": "output", "target": "output",
                 "args": [{"tuple": [{"ref": "sum_1"}, {"dict": {"custom/n:mean": {"ref": "sum_1"}}}]}],
                 "kwargs": {}}]}}),
        Call("POST", "/api/v1/optim_step", body={"model_id": m, "seq_id": app.number(), "type": "optim_step",
                                                 "adam_params": {"learning_rate": 1e-3, "beta1": 0.9}}),
        Call("POST", "/api/v1/unload_model", body={"model_id": app.new_model(), "seq_id": 1}),
        Call("POST", "/api/v1/save_weights_for_sampler", body={
            "model_id": m, "path": app.name("sw"), "seq_id": app.number(), "ttl_seconds": 7200,
            "user_metadata": meta}),
        Call("POST", "/api/v1/create_sampling_session", body={
            "session_id": s, "sampling_session_seq_id": app.number(),
            "model_path": app.tinker_path("sampler_weights", app.sampler_weights)}),
        Call("POST", "/api/v1/join_sampling_session", body={"sampling_session_id": app.sampler_id}),
        Call("GET", "/api/v1/samplers/{sampler_id}", {"sampler_id": app.sampler_id}),
        Call("POST", "/api/v1/asample", body=sample_body(app)),
        Call("POST", "/api/v1/save_weights", body={"model_id": m, "path": app.name("w"), "seq_id": app.number(),
                                                   "ttl_seconds": 7200, "user_metadata": meta}),
        Call("POST", "/api/v1/save_weights_external", body={"model_id": m, "path": app.name("e"),
                                                            "seq_id": app.number(),
                                                            "age_encryption_recipients": [AGE_RECIPIENT]}),
        Call("POST", "/api/v1/load_weights", body={
            "path": app.tinker_path("weights", app.weights), "session_id": s, "model_seq_id": app.number(),
            "optimizer": True, "base_model": b, "user_metadata": meta}),
        Call("GET", "/api/v1/training_runs", query={"limit": 5, "offset": 0, "access_scope": "owned"}),
        Call("GET", "/api/v1/training_runs/{run_id}", {"run_id": m}),
        Call("GET", "/api/v1/training_runs/{run_id}/checkpoints", {"run_id": m}),
        Call("GET", "/api/v1/checkpoints", query={"limit": 5, "offset": 0}),
        Call("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}",
             {**run_ck, "name": app.save("save_weights", "del")}),
        Call("POST", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish",
             {**run_ck, "name": app.save("save_weights", "pub")}),
        Call("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish",
             {**run_ck, "name": fresh_public}),
        Call("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl",
             {**run_ck, "name": app.weights}, body={"ttl_seconds": 7200}),
        Call("POST", "/api/v1/weights_info", body={"tinker_path": app.tinker_path("weights", app.weights)}),
        Call("POST", "/api/v1/copy_weights", body={
            "source_path": app.tinker_path("weights", app.weights), "session_id": s, "model_seq_id": app.number(),
            "ttl_seconds": 7200, "destination_project_id": "p"}),
        Call("GET", "/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls",
             {"run_id": m, "name": app.external}),
        Call("GET", "/api/v1/downloads/{run_id}/{name}/{expires}/{sig}/{filename}",
             dict(zip(("run_id", "name", "expires", "sig", "filename"), download))),
        Call("GET", "/api/v1/downloads/{run_id}/{kind}/{name}/{expires}/{sig}/{filename}",
             dict(zip(("run_id", "kind", "name", "expires", "sig", "filename"), download_kind))),
        Call("POST", "/api/v1/retrieve_future", body={"request_id": app.accepted[-1], "allow_metadata_only": True}),
        Call("GET", "/dashboard"),
        Call("GET", "/dashboard/"),
        Call("GET", "/dashboard/{asset}", {"asset": "dashboard.js"}),
        Call("GET", "/dashboard/api/summary"),
        Call("GET", "/dashboard/api/runs/{model_id}", {"model_id": m}),
        Call("GET", "/dashboard/api/runs/{model_id}/checkpoints/{kind}/{name}/files",
             {"model_id": m, "kind": "weights", "name": app.weights}),
        *[call for prefix in ("/v1", "/oai/api/v1") for call in (
            Call("GET", prefix + "/models"),
            Call("GET", prefix + "/models/{model:path}", {"model": app.base_model}),
            Call("POST", prefix + "/completions", body={"model": app.base_model, "prompt": "12", "max_tokens": 2,
                                                        "temperature": 0.5, "n": 1, "stop": ["x"], "seed": 3}),
            Call("POST", prefix + "/chat/completions", body={
                "model": app.base_model, "messages": [{"role": "user", "content": "12"}], "max_tokens": 2,
                "top_p": 0.9, "logprobs": True, "top_logprobs": 2}),
        )],
        Call("GET", "/api/v1/sessions/{session_id}/trace_export", {"session_id": s}),
        Call("GET", "/api/v1/trace_downloads/{session_id}/{expires}/{sig}",
             dict(zip(("session_id", "expires", "sig"), trace))),
        Call("GET", "/api/v1/billing/usage/events",
             query={"starting_on": hour.isoformat(), "ending_before": (hour + timedelta(hours=1)).isoformat()}),
        Call("GET", "/api/v1/billing/usage/checkpoints/current", query={"project_id": "p"}),
        Call("POST", "/api/v1/retrieve_futures", body={
            "target": {"type": "sampling_session", "sampling_session_id": app.sampler_id, "cloned_sampler_id": 0},
            "prev_cursor": 0, "timeout": 0, "retrieved_request_ids": []}),
        Call("POST", "/api/v1/cancel_future", body={"request_id": app.ok("POST", "/api/v1/asample", sample_body(app))[
            "request_id"]}),
    ]


def app_routes() -> set[tuple[str, str]]:
    return {(method, r.path) for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)
            for method in r.methods}


def reads_json(call: Call) -> bool:
    return call.body is not None


class Report:
    """Collects the cases that went wrong, to show them all at once."""

    def __init__(self) -> None:
        self.wrong: list[str] = []

    def expect(self, ok: bool, call: Call, what: str, r) -> None:
        if not ok:
            self.wrong.append(f"{call.method} {call.route} [{what}] -> {r.status_code} {r.text[:300]}")

    def check(self) -> None:
        assert not self.wrong, f"{len(self.wrong)} case(s):\n" + "\n".join(self.wrong)


# ------------------------------------------------------------------------------ JSON mutations
def leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` of every scalar of a JSON value (of a list, its first element only)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, list):
        if obj:
            yield from leaves(obj[0], path + (0,))
    else:
        yield path, obj


def dict_paths(obj: Any, path: tuple = ()) -> Iterator[tuple]:
    """The path of every JSON object inside ``obj`` (of a list, its first element only)."""
    if isinstance(obj, dict):
        yield path
        for k, v in obj.items():
            yield from dict_paths(v, path + (k,))
    elif isinstance(obj, list) and obj:
        yield from dict_paths(obj[0], path + (0,))


def at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def with_leaf(body: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(body)
    at(out, path[:-1])[path[-1]] = value
    return out


def with_key(body: Any, path: tuple, key: str, new_key: str) -> Any:
    out = copy.deepcopy(body)
    d = at(out, path)
    d[new_key] = d.pop(key)
    return out


def field_name(path: tuple) -> str:
    return [p for p in path if isinstance(p, str)][-1]


def spoiled(value: str, bad: str) -> str:
    """The string with a hostile character appended (a spoiled key stays readable in messages)."""
    return value + bad


def refused_naming(r, name: str) -> bool:
    """A 4xx whose message names ``name``: Tinker routes answer ``{"detail"}``, the OpenAI-compatible
    ones OpenAI's ``{"error": {"message", "param"}}``."""
    if not 400 <= r.status_code < 500:
        return False
    body = r.json()
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    return any(name in str(text) for text in (body.get("detail", ""), error.get("message", ""), error.get("param", "")))


# -------------------------------------------------------------------------------------- tests
def test_every_route_has_a_valid_request(app):
    calls = valid_calls(app)
    assert {(c.method, c.route) for c in calls} == app_routes()
    report = Report()
    for call in calls:
        r = call.send(app)
        report.expect(r.status_code == 200, call, "valid", r)
    report.check()


def test_nul_and_lone_surrogates_are_refused_naming_the_field(app):
    report = Report()
    for call in valid_calls(app):
        if reads_json(call):
            for path, value in leaves(call.body):
                if isinstance(value, str):
                    for bad in (NUL, SURROGATE):
                        r = call.send(app, with_leaf(call.body, path, spoiled(value, bad)))
                        report.expect(refused_naming(r, field_name(path)), call, f"{path} {bad!r}", r)
            for path in dict_paths(call.body):
                for key in list(at(call.body, path)):
                    for bad in (NUL, SURROGATE):
                        r = call.send(app, with_key(call.body, path, key, spoiled(key, bad)))
                        report.expect(refused_naming(r, key), call, f"key {path + (key,)} {bad!r}", r)
        for name, value in call.path.items():
            r = call.send(app, url=call.url(**{name: spoiled(value, NUL)}))
            report.expect(refused_naming(r, name), call, f"path {name}", r)
        for name, value in call.query.items():
            r = call.send(app, query={**call.query, name: spoiled(str(value), NUL)})
            report.expect(refused_naming(r, name), call, f"query {name}", r)
    report.check()


def test_integers_beyond_64_bits_are_refused_naming_the_field(app):
    report = Report()
    for call in valid_calls(app):
        if reads_json(call):
            for path, value in leaves(call.body):
                if "user_metadata" in path:  # free-form, stored as JSON: any integer fits
                    continue
                if isinstance(value, int) and not isinstance(value, bool):
                    for wide in WIDE_INTS:
                        r = call.send(app, with_leaf(call.body, path, wide))
                        report.expect(refused_naming(r, field_name(path)), call, f"{path}={wide}", r)
        for name, value in call.query.items():
            if isinstance(value, int):
                for wide in WIDE_INTS:
                    r = call.send(app, query={**call.query, name: wide})
                    report.expect(refused_naming(r, name), call, f"query {name}={wide}", r)
    report.check()


def test_nan_and_infinities_are_refused_naming_the_field(app):
    """NaN, Infinity and numbers that overflow to it (1e999): never stored. Loss inputs may hold
    them on the wire (the worker refuses them with the request's future); anything else is
    refused when it arrives."""
    report = Report()
    for call in valid_calls(app):
        if reads_json(call):
            for path, value in leaves(call.body):
                if isinstance(value, float):
                    for literal in (b"NaN", b"-Infinity", b"1e999"):
                        raw = json.dumps(with_leaf(call.body, path, "@@")).encode().replace(b'"@@"', literal)
                        r = call.send(app, raw=raw)
                        if "loss_fn_inputs" in path:
                            report.expect(r.status_code < 500, call, f"{path}={literal!r}", r)
                        else:
                            report.expect(refused_naming(r, field_name(path)), call, f"{path}={literal!r}", r)
    report.check()


def test_model_seq_id_fits_its_column(app):
    """model_seq_id is stored as a 32-bit integer: one past it is refused, the largest one is taken."""
    body = {"session_id": app.session_id, "base_model": app.base_model, "lora_config": {"rank": 4}}
    r = app.send("POST", "/api/v1/create_model", {**body, "model_seq_id": 1 << 31})
    assert r.status_code == 400 and "model_seq_id" in r.text, r.text
    app.done(app.ok("POST", "/api/v1/create_model", {**body, "model_seq_id": (1 << 31) - 1}))


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"n": value}
    return value


@sqlite_only
def test_a_client_gone_before_its_body_arrived_is_no_server_error(app):
    """A client that closes its connection halfway through a body (the SDK cancels a pending poll
    when it closes) gets no 500 and leaves no traceback (the autouse check): the request ends as
    499, and the app goes on serving."""
    sent: list[dict] = []

    async def call() -> None:
        messages = iter([{"type": "http.request", "body": b'{"target": {', "more_body": True},
                         {"type": "http.disconnect"}])

        async def receive() -> dict:
            return next(messages, {"type": "http.disconnect"})

        async def send(message: dict) -> None:
            sent.append(message)

        path = "/api/v1/retrieve_futures"
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"x-api-key", KEY["X-API-Key"].encode()), (b"content-type", b"application/json"),
                             (b"content-length", b"400")],
                 "client": ("testclient", 50000), "server": ("testserver", 80)}
        await app.client.app(scope, receive, send)

    app.client.portal.call(call)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    app.ok("POST", "/api/v1/create_session", {"tags": ["after a client left"]})


@sqlite_only
def test_deeply_nested_json_is_refused(app):
    report = Report()
    deep = b"[" * 100_000 + b"]" * 100_000
    for call in valid_calls(app):
        if not reads_json(call):
            continue
        r = call.send(app, raw=deep)
        report.expect(r.status_code == 400 and "nested" in r.text, call, "100000 levels", r)
        if isinstance(call.body, dict) and "user_metadata" in call.body:
            r = call.send(app, {**call.body, "user_metadata": {"deep": nested(250)}})
            report.expect(r.status_code == 400 and "nested" in r.text, call, "metadata 250 levels", r)
            r = call.send(app, {**call.body, "user_metadata": {"deep": nested(150)}})
            report.expect(r.status_code == 200, call, "metadata 150 levels", r)
    report.check()


# ----------------------------------------------------------------------------- compressed bodies
def zstd(data: bytes, *, declare_size: bool = True) -> bytes:
    c = zstandard.ZstdCompressor(write_content_size=declare_size)
    if declare_size:
        return c.compress(data)
    s = c.compressobj()
    return s.compress(data) + s.flush()


def zeros_bomb(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes that does not declare its size (compressed in pieces)."""
    s = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    piece = bytes(1 << 20)
    out = [s.compress(piece) for _ in range(size >> 20)]
    return b"".join(out) + s.flush()


ZSTD = {"Content-Encoding": "zstd"}


def proto_body(app: App, data: list[T.Datum], seq_id: int | None = None) -> bytes:
    req = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=app.model_id, seq_id=app.number() if seq_id is None else seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


def sft(tokens: list[int]) -> T.Datum:
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


PROTO = {"Content-Type": "application/x-protobuf"}


@sqlite_only
def test_compressed_bodies_are_capped_after_decompression(app):
    report = Report()
    bomb = zeros_bomb(8 * BODY_LIMIT)
    declared = zstd(bytes(8 * BODY_LIMIT))
    assert len(bomb) < BODY_LIMIT and len(declared) < BODY_LIMIT  # within the limit on the wire
    for call in valid_calls(app):
        if not reads_json(call):
            continue
        for name, body in (("streamed", bomb), ("declared", declared)):
            r = call.send(app, raw=body, headers=ZSTD)
            report.expect(r.status_code == 413 and "--max-body-bytes" in r.text, call, name, r)
        # a compressed request within the limit is served like the plain one
        r = call.send(app, raw=zstd(json.dumps(call.body).encode(), declare_size=False), headers=ZSTD)
        report.expect(r.status_code == 200, call, "valid, compressed", r)
    report.check()
    r = app.send("POST", "/api/v1/forward_backward", raw=bomb, headers={**PROTO, **ZSTD})
    assert r.status_code == 413, r.text
    r = app.send("POST", "/api/v1/forward_backward", raw=zstd(proto_body(app, [sft([1, 2, 3])])),
                 headers={**PROTO, **ZSTD})
    assert r.status_code == 200, r.text
    for coding in ("br", "zstd"):  # unsupported; or not what it says
        r = app.send("POST", "/api/v1/create_session", raw=b"{}", headers={"Content-Encoding": coding})
        assert r.status_code == 400 and "Content-Encoding" in r.text, r.text


@sqlite_only
def test_decompression_stops_at_the_limit(app):
    """A 32 KiB body that inflates to 1 GiB costs memory near the limit, not near 1 GiB."""
    bomb = zeros_bomb(1 << 30)
    assert len(bomb) < 64 * 1024
    for route, ctype in (("forward_backward", PROTO), ("asample", JSON_TYPE), ("create_session", JSON_TYPE)):
        tracemalloc.start()
        try:
            r = app.send("POST", f"/api/v1/{route}", raw=bomb, headers={**ctype, **ZSTD})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.status_code == 413, (route, r.text)
        assert peak < 8 * BODY_LIMIT, (route, peak)


# ---------------------------------------------------------------------------------------- sizes
def sequence_numbers(answer: dict) -> list[int]:
    return [int(i.rsplit(":", 1)[1]) for i in answer["sample_sequence_ids"]]


@sqlite_only
def test_sampling_sizes_are_checked_before_anything_is_stored(app):
    first = sequence_numbers(app.ok("POST", "/api/v1/asample", sample_body(app, num_samples=2)))
    stored = app.requests_stored()
    for over, needle in [
        ({"num_samples": 3_000_000}, ["num_samples", "256", "--max-num-samples"]),
        ({"num_samples": 1 << 40}, ["num_samples", "--max-num-samples"]),
        ({"sampling_params": {"max_tokens": CONTEXT + 1}}, ["max_tokens", str(CONTEXT), "context length"]),
        ({"sampling_params": {"max_tokens": 1 << 40}}, ["max_tokens", str(CONTEXT)]),
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1] * (CONTEXT + 1)}]}},
         ["prompt", str(CONTEXT), "context length"]),
    ]:
        r = app.send("POST", "/api/v1/asample", sample_body(app, **over))
        assert r.status_code == 400, (over, r.text)
        assert all(n in r.json()["detail"] for n in needle), (needle, r.text)
    assert app.requests_stored() == stored  # nothing stored ...
    after = sequence_numbers(app.ok("POST", "/api/v1/asample", sample_body(app, num_samples=2)))
    assert after[0] == first[-1] + 1  # ... and no sequence number reserved
    # the default limit is the sampler's own row limit, and that many samples are served
    assert app.state.worker.options.max_sampling_rows == RuntimeOptions.max_sampling_rows == 256
    big = app.ok("POST", "/api/v1/asample", sample_body(app, num_samples=256,
                                                        sampling_params={"max_tokens": 1}))
    assert len(big["sample_sequence_ids"]) == 256


@sqlite_only
def test_forward_sizes_are_checked_before_decoding(app):
    stored = app.requests_stored()
    many = [datum_json([1, 2])] * 1025
    r = app.send("POST", "/api/v1/forward_backward", {
        "forward_backward_input": {"data": many, "loss_fn": "cross_entropy"}, "model_id": app.model_id,
        "seq_id": app.number()})
    assert r.status_code == 400 and "1025" in r.text and "--max-forward-datums" in r.text, r.text
    r = app.send("POST", "/api/v1/forward_backward", raw=proto_body(app, [sft([1, 2])] * 1025), headers=PROTO)
    assert r.status_code == 400 and "1025" in r.text and "--max-forward-datums" in r.text, r.text
    assert app.requests_stored() == stored
    r = app.send("POST", "/api/v1/forward_backward", raw=proto_body(app, [sft([1, 2])] * 1024), headers=PROTO)
    assert r.status_code == 200, r.text


def test_default_limits_take_what_the_sdk_sends():
    from tinsmith.api.limits import RequestLimits

    limits = RequestLimits.of(ServerConfig(), RuntimeOptions.max_sampling_rows)
    limits.check_forward_datums(1024)
    limits.check_forward_tokens(64 * 8192)
    # the SDK splits calls by its client config; the defaults advertised are the SDK's own
    sdk = ClientConfigResponse()
    assert limits.sdk_chunking() == {"fwdbwd_max_chunk_len": sdk.fwdbwd_max_chunk_len,
                                     "fwdbwd_max_chunk_bytes_count": sdk.fwdbwd_max_chunk_bytes_count}


@pytest.fixture(scope="module")
def small_app(qwen3_dir, tmp_path_factory) -> Iterator[App]:
    yield from make_app(qwen3_dir, tmp_path_factory.mktemp("hostile-small"), max_num_samples=4,
                        max_sample_tokens=8, max_prompt_tokens=16, max_forward_datums=3, max_forward_tokens=40)


def test_limits_are_server_options(small_app):
    app = small_app
    assert app.state.worker.options.max_sampling_rows == 4  # the sampler holds what it is allowed
    for over, needle in [
        ({"num_samples": 5}, "--max-num-samples"),
        ({"sampling_params": {"max_tokens": 9}}, "--max-sample-tokens"),
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1] * 17}]}}, "--max-prompt-tokens"),
    ]:
        r = app.send("POST", "/api/v1/asample", sample_body(app, **over))
        assert r.status_code == 400 and needle in r.text, (over, r.text)
    app.ok("POST", "/api/v1/asample", sample_body(app, num_samples=4, sampling_params={"max_tokens": 8},
                                                  prompt={"chunks": [{"type": "encoded_text", "tokens": [1] * 16}]}))
    for data, needle in [([sft([1, 2])] * 4, "--max-forward-datums"), ([sft(list(range(42)))], "--max-forward-tokens")]:
        r = app.send("POST", "/api/v1/forward_backward", raw=proto_body(app, data), headers=PROTO)
        assert r.status_code == 400 and needle in r.text, r.text
    r = app.send("POST", "/api/v1/forward_backward", raw=proto_body(app, [sft(list(range(14)))] * 3), headers=PROTO)
    assert r.status_code == 200, r.text
    # the SDK is told to split forward_backward calls within the limits
    cfg = app.ok("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"})
    assert cfg["fwdbwd_max_chunk_len"] == 3 and cfg["fwdbwd_max_chunk_bytes_count"] == 4 * 40


# ---------------------------------------------------------------------------------------- names
@sqlite_only
@pytest.mark.parametrize("route,kind", [("save_weights", "weights"), ("save_weights_for_sampler", "sampler_weights"),
                                        ("save_weights_external", "external_weights")])
def test_checkpoint_names_are_checked_when_submitted(app, route, kind):
    for bad in ("ok\n", "a" * 201, "a" * 255, "-x", "a..b"):
        r = app.send("POST", f"/api/v1/{route}", {"model_id": app.model_id, "path": bad, "seq_id": app.number()})
        assert r.status_code == 400 and "path" in r.text and "1-200 characters" in r.text, (bad, r.text)
    longest = kind[0] + "a" * 199
    # training state can be overwritten: the second save replaces the first, beside it on disk
    for overwrite in (False, True) if route == "save_weights" else (False,):
        app.done(app.ok("POST", f"/api/v1/{route}", {"model_id": app.model_id, "path": longest,
                                                     "seq_id": app.number(), "overwrite": overwrite}))
    r = app.send("POST", "/api/v1/weights_info", {"tinker_path": app.tinker_path(kind, longest)})
    assert r.status_code == 200, r.text
    r = app.send("POST", "/api/v1/weights_info", {"tinker_path": app.tinker_path(kind, longest + "b")})
    assert r.status_code == 400 and "tinker_path" in r.text, r.text


# ------------------------------------------------------------------------------------- protobuf
@pytest.mark.parametrize("where,spoil", [
    ("model_id", lambda m: setattr(m, "model_id", m.model_id + NUL)),
    ("loss_fn", lambda m: setattr(m, "loss_fn", "cross_entropy" + NUL)),
    ("loss_fn_config_v2", lambda m: m.loss_fn_config_v2[f"k{NUL}"].CopyFrom(pb.LossConfigValue(number=1.0))),
    ("loss_fn_config_v2", lambda m: m.loss_fn_config_v2["k"].CopyFrom(pb.LossConfigValue(text=f"v{NUL}"))),
    ("loss_fn_inputs", lambda m: m.data[0].loss_fn_inputs[f"w{NUL}"].CopyFrom(m.data[0].loss_fn_inputs["target_tokens"])),
    ("sequence_id", lambda m: m.data[0].model_input_spans.add().prompt_tokens.CopyFrom(
        pb.PromptProvenanceSpan(sequence_id=f"s{NUL}", offset=0, length=2))),
])
def test_protobuf_strings_are_checked(app, where, spoil):
    msg = pb.ForwardBackwardRequest.FromString(proto_body(app, [sft([1, 2, 3])]))
    spoil(msg)
    r = app.send("POST", "/api/v1/forward_backward", raw=msg.SerializeToString(), headers=PROTO)
    assert r.status_code == 400 and where in r.text and "NUL" in r.text, r.text


@sqlite_only
def test_sparse_tensors_of_one_request_expand_within_one_budget(app):
    """A CSR target is a few bytes on the wire however wide it is dense; one request's sparse
    tensors together may expand to what a dense body of --max-body-bytes could carry."""
    cols = BODY_LIMIT // 4 // 2  # two rows: one datum's target alone takes the whole budget
    wide = T.TensorData(data=[1, 1], dtype="int64", shape=[2, cols], sparse_crow_indices=[0, 1, 2],
                        sparse_col_indices=[0, 0])
    datum = T.Datum(model_input=T.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": wide})
    r = app.send("POST", "/api/v1/forward", raw=proto_body(app, [datum] * 2), headers=PROTO)
    assert r.status_code == 400 and "data[1]" in r.text and "--max-body-bytes" in r.text, r.text
    r = app.send("POST", "/api/v1/forward", raw=proto_body(app, [datum]), headers=PROTO)
    assert r.status_code == 200, r.text
    targets = {"data": [1], "dtype": "int64", "shape": [2, 2 * cols + 1], "sparse_crow_indices": [0, 1, 1],
               "sparse_col_indices": [0]}
    r = app.send("POST", "/api/v1/asample", sample_body(app, target_prompt_logprobs=targets))
    assert r.status_code == 400 and "target_prompt_logprobs" in r.text and "--max-body-bytes" in r.text, r.text
