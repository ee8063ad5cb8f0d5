"""The start-up log names the HTTP parser and event loop uvicorn will use, and warns when the
fast ones (uvicorn[standard]'s httptools and uvloop) are missing."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from tinsmith.server import logs


def test_the_installed_stack_is_the_fast_one():
    """tinsmith depends on uvicorn[standard]: a set-up by the README has both."""
    assert logs.http_stack() == {"http": "httptools", "loop": "uvloop"}


@pytest.mark.parametrize("absent, http, loop", [
    ({"httptools"}, "h11", "uvloop"),
    ({"uvloop"}, "httptools", "asyncio"),
    ({"httptools", "uvloop"}, "h11", "asyncio"),
])
def test_a_missing_package_falls_back_and_is_warned_of(monkeypatch, caplog, absent, http, loop):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))
    stack = logs.http_stack()
    assert stack == {"http": http, "loop": loop}
    with caplog.at_level(logging.WARNING, logger="tinsmith.server"):
        logs._warn_of_http_fallbacks(stack)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert " and ".join(n for n in ("httptools", "uvloop") if n in absent) + " missing" in message
    assert "uvicorn[standard]" in message and record.fields == stack


def test_nothing_is_warned_of_with_the_fast_stack(caplog):
    with caplog.at_level(logging.WARNING, logger="tinsmith.server"):
        logs._warn_of_http_fallbacks({"http": "httptools", "loop": "uvloop"})
    assert caplog.records == []
