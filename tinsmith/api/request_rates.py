"""Each API key's share of the HTTP layer: a request rate enforced while other keys are served.

The server's event loop answers every HTTP request, and it shares one Python process (one
interpreter lock) with the sampler and the trainer. CPU the loop spends on one key's requests is
time the engine does not spend on any key's work: on the CPU box a key flooding a cheap
authenticated route at 1,000-1,700 requests/s left another key's sampling 0.26-0.49 of its speed
alone (``bench/http_load_micro.py``). The in-flight cap (``--max-requests-in-flight-per-key``)
does not see that traffic: polls, reads and refusals hold nothing in flight.

So each key has a token bucket of requests: ``--request-burst-per-key`` requests at once, refilled
at ``--max-requests-per-second-per-key``. A request that finds its key's bucket empty is refused
with a 429 (``Retry-After``), which the SDK backs off from and retries by itself, **only while
another key is being served**: a key with an HTTP request open, or one that sent a request in the
last :data:`ACTIVE_WINDOW_S` seconds. A key alone on the server is never refused, since nobody
else's work is slowed by its traffic, and its bucket refills meanwhile, so a burst that starts
alone is not cut short when another key arrives.

The defaults sit above what an RL loop sends: a cookbook round of 2,048 separate sample requests
is 4,096 HTTP requests (a submit and one long poll each), half the burst, and such loops average,
by estimate, 200-500 requests/s on a GPU (4,096 requests a round of 2,048 256-token completions
at 35-60k tokens/s; not measured). A key that polls without
pause is held to 512 requests a second while others are served, a quarter of what the CPU box's
loop answers; where tenants are trusted less, a lower rate protects the others more
(``bench/http_load_micro.py --rates 0,default,256`` measures it). The check runs before
the request's body is read or routed, so a refused request costs the loop little. Per-key limits
apply with ``--api-keys-file`` only, as the others in :mod:`tinsmith.server.limits` do.

Refusals are logged once per key per :data:`REPORT_EVERY_S` seconds, with their count, rather
than one warning line each (a flood of refusals would otherwise flood the log); each still gets
its request log line at debug level and its count in the request metrics.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.routing import Match

from tinsmith.api.auth import Authenticator, Caller, key_from_headers
from tinsmith.api.observe import note_request
from tinsmith.errors import AuthError
from tinsmith.tenants import key_id

log = logging.getLogger(__name__)

ACTIVE_WINDOW_S = 5.0  # a key that sent a request this recently counts as being served
REPORT_EVERY_S = 10.0  # at most one warning per key this often about its refused requests
SCOPE_CALLER = "tinsmith.caller"  # where the caller found here waits for the routes (caller_found)


@dataclass
class _Key:
    tokens: float
    refilled_at: float
    last_seen: float
    open: int = 0  # HTTP requests of the key being answered now
    refused: int = 0  # refusals since the last report
    reported_at: float = -math.inf


@dataclass
class RequestRates:
    """Token buckets of HTTP requests, one per key (``owner``); thread-safe.

    ``per_second`` <= 0 turns the limit off. ``clock`` is injectable for tests.
    """

    per_second: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    _keys: dict[str, _Key] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def enabled(self) -> bool:
        return self.per_second > 0

    @classmethod
    def from_config(cls, config, multi_tenant: bool) -> "RequestRates":
        """The rates of a server built from ``config`` (off in single-user mode: one tenant)."""
        per_second = config.max_requests_per_second_per_key if multi_tenant else 0.0
        return cls(per_second=per_second, burst=config.request_burst_per_key)

    def enter(self, owner: str) -> float | None:
        """Count a request of ``owner`` that starts now: None if it may go on (then :meth:`leave`
        must follow when it is answered), else the seconds until its bucket holds a request again."""
        now = self.clock()
        with self._lock:
            key = self._keys.get(owner)
            if key is None:
                key = self._keys[owner] = _Key(tokens=float(self.burst), refilled_at=now, last_seen=now)
            key.tokens = min(float(self.burst), key.tokens + (now - key.refilled_at) * self.per_second)
            key.refilled_at = now
            key.last_seen = now
            if key.tokens < 1.0 and self._others_served(owner, now):
                key.refused += 1
                wait = (1.0 - key.tokens) / self.per_second
                if now - key.reported_at >= REPORT_EVERY_S:
                    self._report(owner, key, now)
                return wait
            key.tokens = max(0.0, key.tokens - 1.0)  # alone it goes on at an empty bucket, which stays empty
            key.open += 1
            return None

    def leave(self, owner: str) -> None:
        """A request :meth:`enter` let through was answered."""
        with self._lock:
            key = self._keys[owner]
            key.open -= 1
            key.last_seen = self.clock()

    def _others_served(self, owner: str, now: float) -> bool:
        """Whether another key has a request open or sent one within the active window (under the lock)."""
        return any(other != owner and (k.open > 0 or now - k.last_seen < ACTIVE_WINDOW_S)
                   for other, k in self._keys.items())

    def _report(self, owner: str, key: _Key, now: float) -> None:
        log.warning("key %s: refused %d request(s) above its %g requests/s (burst %d) while other keys were "
                    "being served (--max-requests-per-second-per-key, --request-burst-per-key)",
                    key_id(owner), key.refused, self.per_second, self.burst)
        key.refused, key.reported_at = 0, now


def caller_found(scope, api_key: str | None) -> Caller | None:
    """The caller the request-rate check authenticated for this request, if it did so for
    ``api_key`` (the key the route reads): the routes need not authenticate it again."""
    found = scope.get(SCOPE_CALLER)
    return found[1] if found is not None and found[0] == api_key else None


def _find_route(scope, routes) -> None:
    """Put the route that would have answered into the scope, as routing does (a refused request is
    never routed), for its log line and metrics label; a path no route serves stays unmatched."""
    partial = None
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.FULL:
            partial = (route, child)
            break
        if match is Match.PARTIAL and partial is None:
            partial = (route, child)
    if partial is not None:
        scope["route"], scope["path_params"] = partial[0], partial[1].get("path_params", {})


class RequestRateLimit:
    """ASGI middleware: refuse a key's request above its rate (:class:`RequestRates`) with a 429,
    before the request's body is read or routed. The caller it authenticated travels on in the
    scope, so the route does not authenticate it again; a request with no valid key goes on to
    be refused by its route, with the route's message."""

    def __init__(self, app, rates: RequestRates, auth: Authenticator, routes=()):
        self.app = app
        self.rates = rates
        self.auth = auth
        self.routes = list(routes)  # the application's routes, to name a refused request's

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.rates.enabled:
            return await self.app(scope, receive, send)
        api_key = key_from_headers(Headers(scope=scope))
        try:
            caller: Caller = self.auth.authenticate(api_key)
        except AuthError:
            return await self.app(scope, receive, send)
        wait = self.rates.enter(caller.owner)
        if wait is not None:
            return await self._refuse(scope, receive, send, wait)
        scope[SCOPE_CALLER] = (api_key, caller)
        try:
            await self.app(scope, receive, send)
        finally:
            self.rates.leave(caller.owner)

    async def _refuse(self, scope, receive, send, wait: float) -> None:
        _find_route(scope, self.routes)
        message = (f"this API key sent more than {self.rates.per_second:g} requests/s (burst "
                   f"{self.rates.burst}) while other keys were being served "
                   "(--max-requests-per-second-per-key); retry shortly")
        note_request(reason=message, quiet=True)
        # Whole seconds, at least one (never the bucket's few milliseconds, and no Retry-After-Ms): the
        # SDK retries every refused request after the wait it is given, all at once, and a wait of a
        # refill's few milliseconds would bring them all back into the same empty bucket at once.
        headers = {"Retry-After": str(max(1, math.ceil(wait)))}
        await JSONResponse({"detail": message}, status_code=429, headers=headers)(scope, receive, send)
