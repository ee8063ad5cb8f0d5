"""The API's routes: no path is answered by two of them, so the order the routers are matched in
(the hot ones first) changes nothing but the time matching takes."""

from __future__ import annotations

import re

from starlette.routing import Match

from tinsmith.api.routes import ROUTERS, futures, sampling, training


def test_no_path_matches_two_routes():
    routes = [r for router in ROUTERS for r in router.routes]
    assert len(routes) > 50
    for route in routes:
        path = re.sub(r"\{[^}]+\}", "x1", route.path)  # the route's template with every parameter filled
        for method in route.methods or {"GET"}:
            scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": [],
                     "query_string": b""}
            others = [o.path for o in routes if o is not route and o.matches(scope)[0] == Match.FULL]
            assert not others, f"{method} {path} matches {route.path} and {others}"


def test_the_routes_loops_call_all_the_time_are_matched_first():
    assert ROUTERS[:3] == [futures.router, sampling.router, training.router]
