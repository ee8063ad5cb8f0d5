"""Alembic environment for the tinsmith store.

``Store.migrate()`` passes an open connection in ``config.attributes["connection"]``. The
Alembic command line (``alembic -c tinsmith/store/alembic.ini ...``) works too: the URL then
comes from ``TINSMITH_DATABASE_URL`` or the ini's ``sqlalchemy.url``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tinsmith.store.connect import make_engine
from tinsmith.store.tables import Base

config = context.config
target_metadata = Base.metadata

# Serialises concurrent migrations on PostgreSQL (two servers starting at once).
_PG_MIGRATION_LOCK = 0x74696E736D697468  # "tinsmith" in ASCII, fits a signed bigint


def _url() -> str:
    url = os.environ.get("TINSMITH_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set TINSMITH_DATABASE_URL or sqlalchemy.url")
    return url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            lock = text("SELECT pg_advisory_xact_lock(:key)")
            connection.execute(lock, {"key": _PG_MIGRATION_LOCK})
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (conn := config.attributes.get("connection")) is not None:
    _run(conn)
else:
    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()
