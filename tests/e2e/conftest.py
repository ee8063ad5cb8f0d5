"""Fixtures of the end-to-end suite: a tiny model, real server processes, SDK clients."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tinker

from tests.conftest import SMALL
from tests.e2e.server import ServerProcess
from tinsmith.devtools.tiny_model import make_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MAX_LORA_RANK = 16  # --max-lora-rank of the shared server
VOCAB = SMALL.vocab_size

KEY_A = "tml-e2e-tenant-a"  # the two keys of the restricted server's --api-keys-file
KEY_B = "tml-e2e-tenant-b"
BODY_LIMIT = 8192  # the restricted server's TINSMITH_MAX_BODY_BYTES

PG_URL = os.environ.get("TINSMITH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3 checkpoint (SMALL shape) with its tokenizer, made offline."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e-model") / "qwen3", "qwen3", SMALL, seed=1)


@pytest.fixture(scope="session")
def base_model(tiny_model) -> str:
    """The name clients use for the served base model (the server serves a directory under its path)."""
    return str(tiny_model)


@pytest.fixture(scope="session")
def make_server(tiny_model, tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory for extra servers; every one made is stopped at the end of the session."""
    made: list[ServerProcess] = []

    def make(*, start: bool = True, data_dir: Path | None = None, **kw) -> ServerProcess:
        d = data_dir or tmp_path_factory.mktemp("e2e-data")
        s = ServerProcess(tiny_model, d, **kw)
        made.append(s)
        return s.start() if start else s

    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="session")
def server(make_server) -> ServerProcess:
    """The shared server of the tests whose tenants do not interfere (rank capped for the rank test)."""
    return make_server(extra_args=["--max-lora-rank", str(MAX_LORA_RANK)])


@pytest.fixture(scope="session")
def restricted_server(make_server, tmp_path_factory) -> ServerProcess:
    """A server that accepts only KEY_A and KEY_B (``--api-keys-file``) and bodies up to BODY_LIMIT bytes."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys.txt"
    keys.write_text(f"# two tenants\n{KEY_A}\n\n{KEY_B}  # second\n")
    return make_server(api_keys_file=keys, env={"TINSMITH_MAX_BODY_BYTES": str(BODY_LIMIT)})


@pytest.fixture
def service_client(server) -> Iterator[Callable[..., tinker.ServiceClient]]:
    """``service_client(srv=server, api_key=...)`` -> a 0.38 ``ServiceClient``, closed after the test."""
    clients: list[tuple[tinker.ServiceClient, ServerProcess]] = []

    def make(srv: ServerProcess | None = None, api_key: str = "tml-e2e-local"):
        srv = srv or server
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key=api_key)
        clients.append((sc, srv))
        return sc

    yield make
    for sc, srv in clients:
        if not srv.running:  # the test stopped or killed it: nothing to finish the session on
            continue
        try:
            sc.close("success").result(timeout=60)
        except Exception:  # noqa: BLE001 - already closed by the test, or its session is gone
            pass


@pytest.fixture
def sc(service_client) -> tinker.ServiceClient:
    """A ServiceClient of the shared server."""
    return service_client()


@pytest.fixture(scope="session")
def postgres_admin():
    """An autocommit connection to the test PostgreSQL server, or a visible skip."""
    try:
        import psycopg
        from sqlalchemy.engine import make_url

        plain = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
        conn = psycopg.connect(plain, connect_timeout=3, autocommit=True)
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "not reachable"
        pytest.skip(f"PostgreSQL not reachable at {PG_URL.split('@')[-1]}: {exc}")
    yield conn
    conn.close()


@pytest.fixture
def postgres_url(postgres_admin) -> Iterator[str]:
    """A scratch database ``tinsmith_e2e_<random>`` on the test server, dropped afterwards."""
    from sqlalchemy.engine import make_url

    name = f"tinsmith_e2e_{uuid.uuid4().hex[:12]}"
    postgres_admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        postgres_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
