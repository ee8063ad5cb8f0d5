"""Fixtures: every store test runs on SQLite (tmp dir) and on PostgreSQL.

PostgreSQL tests get a fresh schema each (via ``search_path`` in the URL), dropped afterwards,
so concurrent runs on the same server never see each other's tables. When the server is not
reachable they are skipped with the reason, never passed silently.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from tinsmith.store import Store

PG_URL = os.environ.get(
    "TINSMITH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


class FakeClock:
    """A deterministic UTC clock that moves 1 ms per reading (so creation order is total)."""

    def __init__(self, start: datetime = datetime(2025, 1, 1, tzinfo=UTC)) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            self.now += timedelta(milliseconds=1)
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += timedelta(seconds=seconds)


class PostgresServer:
    """Creates and drops throw-away schemas on the test server."""

    def __init__(self, url: str) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        self.url = url
        plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(plain, connect_timeout=3, autocommit=True)

    def new_schema(self) -> str:
        schema = f"tinsmith_test_{uuid.uuid4().hex[:16]}"
        self.conn.execute(f'CREATE SCHEMA "{schema}"')
        return schema

    def drop_schema(self, schema: str) -> None:
        self.conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def url_for(self, schema: str, **options: str) -> str:
        opts = [f"-csearch_path={schema}"] + [f"-c{k}={v}" for k, v in options.items()]
        return f"{self.url}?options={'%20'.join(o.replace('=', '%3D') for o in opts)}"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer(PG_URL)
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "not reachable"
        pytest.skip(f"PostgreSQL not reachable at {PG_URL.split('@')[-1]}: {exc}")
    yield server
    server.conn.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A URL to an empty database of each backend."""
    if request.param == "sqlite":
        yield Store.default_sqlite_url(tmp_path / "data")
        return
    server: PostgresServer = request.getfixturevalue("postgres")
    schema = server.new_schema()
    try:
        yield server.url_for(schema)
    finally:
        server.drop_schema(schema)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db_url: str, clock: FakeClock) -> Iterator[Store]:
    """A migrated Store on each backend."""
    s = Store(db_url, clock=clock)
    s.migrate()
    yield s
    s.close()
