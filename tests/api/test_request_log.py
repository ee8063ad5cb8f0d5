"""The request log line, in-process: its fields, its level, and no API key in it."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from tinsmith.api.observe import RequestObserver, note_request
from tinsmith.server.logs import JsonFormatter, TEXT_FORMAT
from tinsmith.server.metrics import ServerMetrics
from tinsmith.tenants import key_id_for_api_key

SECRET = "tml-request-log-secret-77"


def make_app() -> tuple[FastAPI, ServerMetrics]:
    metrics = ServerMetrics()
    app = FastAPI()
    app.add_middleware(RequestObserver, metrics=metrics)

    @app.post("/runs/{model_id}/work")
    async def work(model_id: str) -> dict:
        note_request(tokens=12)
        return {"ok": True}

    @app.post("/busy")
    async def busy() -> JSONResponse:
        note_request(reason="this API key already has 4 requests queued or running")
        return JSONResponse({"detail": "busy"}, status_code=429)

    return app, metrics


def test_request_lines_in_text_and_json(caplog):
    app, metrics = make_app()
    caplog.set_level(logging.INFO, logger="tinsmith.requests")
    with TestClient(app) as client:
        assert client.post("/runs/run-7/work", headers={"X-API-Key": SECRET}).status_code == 200
        assert client.post("/busy", headers={"X-API-Key": SECRET}).status_code == 429
    ok, busy = [r for r in caplog.records if r.name == "tinsmith.requests"]
    kid = key_id_for_api_key(SECRET)
    text = logging.Formatter(TEXT_FORMAT).format(ok)
    assert text.endswith(f"request POST /runs/{{model_id}}/work 200 {ok.fields['duration_ms']:.1f} ms key={kid} "
                         "run=run-7 tokens=12"), text
    assert ok.levelno == logging.INFO and busy.levelno == logging.WARNING
    as_json = json.loads(JsonFormatter().format(busy))
    assert as_json["status"] == 429 and as_json["key_id"] == kid and as_json["level"] == "warning"
    assert "queued or running" in as_json["reason"]
    for record in (ok, busy):
        assert SECRET not in logging.Formatter(TEXT_FORMAT).format(record)
        assert SECRET not in JsonFormatter().format(record)
    assert metrics.registry.get_sample_value("tinsmith_http_requests_total",
                                             {"route": "/busy", "method": "POST", "status": "429"}) == 1
