"""Fixtures of the RL and checkpoint suite: the end-to-end fixtures, re-exported.

``tiny_model``/``base_model`` (a tiny random Qwen3 made offline), ``make_server`` (extra server
processes, stopped at the end), ``server`` (the shared server, LoRA rank capped at 16) and
``service_client``/``sc`` (0.38 ``ServiceClient`` objects closed after each test) come from
``tests/e2e/conftest.py`` unchanged.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.e2e.conftest import (  # noqa: E402,F401  (fixtures, found by pytest by name)
    base_model,
    make_server,
    sc,
    server,
    service_client,
    tiny_model,
)
