from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from tinsmith.store import Store
from tinsmith.store.connect import alembic_config, run_migrations
from tinsmith.store.tables import Base

HEAD = ScriptDirectory.from_config(alembic_config()).get_current_head()
TABLES = {"sessions", "models", "requests", "sampling_sessions", "checkpoints", "server_lease", "run_metrics"}


def test_migrate_from_empty_twice_is_idempotent(db_url: str) -> None:
    store = Store(db_url)
    try:
        assert store.schema_revision() is None
        store.migrate()
        assert store.schema_revision() == HEAD
        session = store.create_session("alice")
        store.migrate()  # second run: no error, no data loss
        assert store.schema_revision() == HEAD
        assert store.get_session(session.session_id) == session
        assert set(inspect(store.engine).get_table_names()) >= TABLES
    finally:
        store.close()


def test_0003_keeps_requests_and_adds_lease_and_retention(db_url: str) -> None:
    """Upgrading a 0002 database keeps its requests (nothing purged), adds the lease table and
    the indexes; downgrading and upgrading again round-trips."""
    store = Store(db_url)
    try:
        run_migrations(store.engine, "0002")
        assert store.schema_revision() == "0002"
        with store.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO requests (request_id, owner, kind, payload, payload_type, status, result, "
                    "result_content_type, created_at, completed_at) VALUES ('req-1', 'o', 'forward', :p, "
                    "'protobuf', 'completed', :r, 'application/x-protobuf', :t, :t)"
                ),
                {"p": b"\x00payload", "r": b"\x01result", "t": datetime(2025, 1, 1, tzinfo=UTC)},
            )
        store.migrate()
        assert store.schema_revision() == HEAD
        got = store.get_request("req-1")
        assert (got.payload, got.result, got.purged_at) == (b"\x00payload", b"\x01result", None)
        assert store.get_lease() is None
        indexes = {i["name"] for t in ("requests", "sessions") for i in inspect(store.engine).get_indexes(t)}
        assert {"ix_requests_purged_at_completed_at", "ix_sessions_finished_at_last_heartbeat_at"} <= indexes

        config = alembic_config()
        with store.engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0002")
        assert "server_lease" not in inspect(store.engine).get_table_names()
        assert "purged_at" not in {c["name"] for c in inspect(store.engine).get_columns("requests")}
        store.migrate()
        assert store.get_request("req-1").payload == b"\x00payload"
    finally:
        store.close()


def test_0004_adds_run_metrics_and_round_trips(db_url: str) -> None:
    """Upgrading a 0003 database adds the empty run_metrics table; down and up again round-trips."""
    store = Store(db_url)
    try:
        run_migrations(store.engine, "0003")
        store.create_session("alice")
        store.migrate()
        assert "run_metrics" in inspect(store.engine).get_table_names()
        assert store.list_run_metrics("any") == []
        config = alembic_config()
        with store.engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0003")
        assert "run_metrics" not in inspect(store.engine).get_table_names()
        store.migrate()
        assert store.schema_revision() == HEAD
    finally:
        store.close()


def test_migrate_at_head_runs_nothing(db_url: str, caplog) -> None:
    """An up-to-date database is not migrated again: a start logs nothing about migrations."""
    store = Store(db_url)
    try:
        store.migrate()
        caplog.clear()
        with caplog.at_level("DEBUG", logger="alembic"):
            store.migrate()
        # Only the migration's own loggers: another thread (an SDK client an earlier test left
        # behind, whose server is gone) may log a warning meanwhile, which says nothing of this.
        assert [r for r in caplog.records if r.name.startswith(("alembic", "tinsmith"))] == []
        assert store.schema_revision() == HEAD
    finally:
        store.close()


def test_migrations_match_the_table_definitions(store: Store) -> None:
    """The hand-written migrations must create exactly what tables.py describes."""
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []


def test_migrate_works_from_another_working_directory(tmp_path: Path) -> None:
    """The migration scripts are found through the package, not through the CWD."""
    db = tmp_path / "elsewhere" / "db"
    code = (
        "from tinsmith.store import Store; "
        f"s = Store(Store.default_sqlite_url({str(db)!r})); s.migrate(); "
        "print(s.schema_revision()); s.close()"
    )
    # PYTHONPATH: this checkout's package, wherever the environment installed one from.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == HEAD
    assert (db / "tinsmith.sqlite").exists()


def test_sqlite_connection_settings(tmp_path: Path) -> None:
    store = Store(Store.default_sqlite_url(tmp_path))
    try:
        with store.engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 5000
    finally:
        store.close()


def test_unsupported_url_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported database URL"):
        Store("mysql://u@h/db")


def test_unique_keys_allow_many_nulls(store: Store) -> None:
    """Both backends treat NULLs as distinct in (model_id, seq_id) and
    (sampling_session_id, seq_id): unordered requests never collide."""
    ids = set()
    for _ in range(3):
        for kwargs in ({}, {"model_id": "m"}, {"sampling_session_id": "s"}, {"seq_id": 7}):
            rec, created = store.create_request(
                owner="o", kind="k", payload=b"", payload_type="json", **kwargs
            )
            assert created
            ids.add(rec.request_id)
    assert len(ids) == 12


def test_datetimes_are_aware_utc(store: Store, clock) -> None:
    session = store.create_session("o")
    assert session.created_at.tzinfo is not None
    assert session.created_at.utcoffset().total_seconds() == 0
    assert store.get_session(session.session_id).created_at == session.created_at
    with pytest.raises(ValueError, match="naive datetime"):
        store.list_expired(datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="naive datetime"):
        store.put_checkpoint(
            "r", "weights", "n", owner="o", storage_path="/x", expires_at=datetime(2030, 1, 1)
        )
    assert store.get_checkpoint("r", "weights", "n") is None


@pytest.mark.postgres
def test_postgres_non_utc_session_timezone(postgres) -> None:
    """A server or role with another TimeZone still yields the same UTC instants."""
    schema = postgres.new_schema()
    try:
        store = Store(postgres.url_for(schema, timezone="America/New_York"))
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text("SHOW timezone")).scalar() == "America/New_York"
        moment = datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=UTC)
        store.put_checkpoint("run", "weights", "a", owner="o", storage_path="/x", expires_at=moment)
        got = store.get_checkpoint("run", "weights", "a").expires_at
        assert got == moment and got.tzinfo == UTC
        store.close()
    finally:
        postgres.drop_schema(schema)
