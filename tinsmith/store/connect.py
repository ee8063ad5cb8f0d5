"""Engines and migrations: SQLite (embedded default) and PostgreSQL (``postgresql+psycopg``).

Migrations are configured in code, pointing at the ``migrations`` folder shipped inside this
package, so ``Store.migrate()`` works from an installed wheel and from any working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Writers wait this long for the SQLite write lock before failing with "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_sqlite_url(data_dir: str | Path) -> str:
    """The embedded database: ``{data_dir}/tinsmith.sqlite``."""
    return f"sqlite:///{Path(data_dir).expanduser().resolve() / 'tinsmith.sqlite'}"


def is_sqlite_memory(database: str | None) -> bool:
    return not database or database == ":memory:" or database.startswith("file::memory:")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (future polls, listings) proceed while one writer commits; NORMAL
    # sync is durable across process crashes in WAL mode and far cheaper than FULL.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """Create a thread-safe engine for ``url`` with the settings each backend needs."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        connect_args = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        if is_sqlite_memory(parsed.database):
            # One shared connection, or every pooled connection would see its own empty DB.
            engine = create_engine(
                parsed, echo=echo, connect_args=connect_args, poolclass=StaticPool
            )
        else:
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(parsed, echo=echo, connect_args=connect_args)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if backend == "postgresql":
        try:
            import psycopg  # noqa: F401 - the driver is an optional extra
        except ImportError:
            raise ValueError("a postgresql database URL needs the PostgreSQL driver: "
                             "pip install 'tinsmith[postgres]'") from None
        return create_engine(parsed, echo=echo, pool_pre_ping=True)
    raise ValueError(
        f"unsupported database URL {parsed.render_as_string()!r}: use sqlite or postgresql"
    )


def alembic_config() -> Config:
    """An Alembic config built in code (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def _stamped_revision(engine: Engine) -> str | None:
    """The revision in ``alembic_version``, read with plain SQL (no Alembic context, no log lines)."""
    with engine.connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return None
        return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def run_migrations(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision``; a no-op when it is already there.

    An up-to-date database (every start but the first after an upgrade) is recognised without
    entering Alembic, so a start-up that is about to be refused prints nothing but the reason.
    """
    config = alembic_config()
    target = ScriptDirectory.from_config(config).get_current_head() if revision == "head" else revision
    if _stamped_revision(engine) == target:
        return
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current_revision(engine: Engine) -> str | None:
    """The schema revision stamped in the database (None for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
