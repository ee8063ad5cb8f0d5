"""A key's request rate (tinsmith.api.request_rates): refused only above its bucket and only while
another key is being served; the middleware answers 429 before the route, and hands the caller on."""

from __future__ import annotations

import logging

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from tinsmith.api import request_rates
from tinsmith.api.auth import Authenticator, owner_for_key
from tinsmith.api.common import caller_of
from tinsmith.api.request_rates import ACTIVE_WINDOW_S, REPORT_EVERY_S, RequestRateLimit, RequestRates
from tinsmith.api.routes.openai_compat import caller_of as openai_caller_of
from tinsmith.errors import AuthError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rates(per_second: float = 10.0, burst: int = 3) -> tuple[RequestRates, Clock]:
    clock = Clock()
    return RequestRates(per_second=per_second, burst=burst, clock=clock), clock


def _take(rates: RequestRates, owner: str, n: int) -> list[float | None]:
    """``n`` requests of ``owner``, each answered at once."""
    out = []
    for _ in range(n):
        wait = rates.enter(owner)
        if wait is None:
            rates.leave(owner)
        out.append(wait)
    return out


def test_a_key_alone_is_never_refused():
    rates, clock = _rates()
    assert _take(rates, "a", 50) == [None] * 50
    clock.now += ACTIVE_WINDOW_S + 1  # nobody else came meanwhile
    assert _take(rates, "a", 50) == [None] * 50


def test_beyond_its_burst_a_key_is_refused_while_another_is_served():
    rates, clock = _rates(per_second=10.0, burst=3)
    assert rates.enter("b") is None  # b's request stays open: b is being served
    assert _take(rates, "a", 3) == [None] * 3
    waits = _take(rates, "a", 2)
    assert waits == [pytest.approx(0.1), pytest.approx(0.1)]  # a refusal costs no token
    assert rates.enter("b") is None  # b has its own bucket
    rates.leave("b")
    clock.now += 0.1  # one request's worth refilled
    assert _take(rates, "a", 2) == [None, pytest.approx(0.1)]
    rates.leave("b")


def test_a_key_seen_lately_counts_as_served_until_the_window_passes():
    rates, clock = _rates(per_second=1.0, burst=2)
    _take(rates, "b", 1)  # answered, nothing open
    _take(rates, "a", 2)
    clock.now += ACTIVE_WINDOW_S - 0.5  # 4.5 tokens refilled, capped at the burst of 2
    assert _take(rates, "a", 3) == [None, None, pytest.approx(1.0)]
    clock.now += 1.0  # b last seen 5.5 s ago: a is alone again, and its empty bucket does not hold it back
    assert _take(rates, "a", 5) == [None] * 5


def test_a_burst_that_starts_alone_keeps_its_bucket_when_another_key_arrives():
    rates, clock = _rates(per_second=1.0, burst=4)
    clock.now += 100.0
    assert rates.enter("b") is None
    assert _take(rates, "a", 5) == [None] * 4 + [pytest.approx(1.0)]


def test_refusals_are_reported_once_per_key_and_while(caplog):
    rates, clock = _rates(per_second=1.0, burst=1)
    rates.enter("key-0123456789abcdef01234567")
    with caplog.at_level(logging.WARNING, logger=request_rates.__name__):
        assert _take(rates, "key-aaaaaaaabbbbbbbbcccccccc", 6)[1:] == [pytest.approx(1.0)] * 5
        clock.now += REPORT_EVERY_S
        _take(rates, "key-aaaaaaaabbbbbbbbcccccccc", 3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("key aaaaaaaa: refused 1 request(s)")  # the first refusal is reported at once
    assert lines[1].startswith("key aaaaaaaa: refused 5 request(s)")  # 4 unreported, then the next while's first


# ------------------------------------------------------------------------------ the middleware
def _app(tmp_path, per_second: float, burst: int) -> tuple[TestClient, Authenticator]:
    keys = tmp_path / "keys.txt"
    keys.write_text("tml-a\ntml-b\n")
    auth = Authenticator(str(keys))
    routed = []

    class State:  # what caller_of reads when the middleware did not authenticate
        pass

    app = FastAPI()
    app.state.tinsmith = State()
    app.state.tinsmith.auth = auth

    @app.post("/work")
    async def work(request: Request, caller=Depends(caller_of)):
        routed.append(caller.owner)
        return {"body": (await request.body()).decode()}

    @app.post("/v1/work")  # as the OpenAI-compatible routes read their key (a bearer token)
    async def bearer_work(request: Request):
        routed.append(openai_caller_of(request).owner)
        return {}

    app.add_middleware(RequestRateLimit, rates=RequestRates(per_second=per_second, burst=burst), auth=auth)
    client = TestClient(app)
    client.routed = routed
    return client, auth


def test_the_middleware_refuses_before_the_route_and_hands_the_caller_on(tmp_path, monkeypatch):
    client, auth = _app(tmp_path, per_second=0.001, burst=2)
    calls = []
    authenticate = auth.authenticate
    monkeypatch.setattr(auth, "authenticate", lambda key: calls.append(key) or authenticate(key))
    assert client.post("/work", headers={"X-API-Key": "tml-b"}, content="b").status_code == 200
    assert calls == ["tml-b"]  # once, in the middleware: the route took the caller it found
    ok = [client.post("/work", headers={"X-API-Key": "tml-a"}, content="x") for _ in range(2)]
    assert [r.json() for r in ok] == [{"body": "x"}] * 2
    r = client.post("/work", headers={"X-API-Key": "tml-a"}, content="x")
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1000"  # whole seconds until the bucket holds a request
    assert "--max-requests-per-second-per-key" in r.json()["detail"]
    assert client.routed == [owner_for_key("tml-b")] + [owner_for_key("tml-a")] * 2  # the refused one never routed
    calls.clear()
    assert client.post("/v1/work", headers={"Authorization": "Bearer tml-b"}).status_code == 200
    assert calls == ["tml-b"] and client.routed[-1] == owner_for_key("tml-b")  # a bearer key: once too


def test_requests_without_a_valid_key_reach_the_route_and_its_message(tmp_path):
    client, _ = _app(tmp_path, per_second=0.001, burst=1)
    for headers, message in (({}, "missing X-API-Key"), ({"X-API-Key": "tml-unknown"}, "not accepted")):
        for _ in range(3):  # never counted against a bucket: the route's own 401 each time
            with pytest.raises(AuthError, match=message):
                client.post("/work", headers=headers, content="x")
    assert client.routed == []
