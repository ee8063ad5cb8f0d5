"""One server per database (server_lease); request payloads purged after retention; indexed expiry.

* ``server_lease``: the row a running server holds and renews, so a second server on the same
  database refuses to start instead of marking the first one's runs lost.
* ``requests.purged_at``: when the payload and result were dropped (the record stays), with an
  index on ``(purged_at, completed_at)`` for the retention sweep.
* ``sessions (finished_at, last_heartbeat_at)``: the sweeper's session-expiry queries.

Only additions: no table is rewritten, so the upgrade is quick on a large requests table.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "server_lease",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("pid_namespace", sa.String(), nullable=True),
        sa.Column("data_dir", sa.String(), nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_server_lease"),
    )
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("purged_at", TS, nullable=True))
    op.create_index("ix_requests_purged_at_completed_at", "requests", ["purged_at", "completed_at"])
    op.create_index(
        "ix_sessions_finished_at_last_heartbeat_at", "sessions", ["finished_at", "last_heartbeat_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_sessions_finished_at_last_heartbeat_at", table_name="sessions")
    op.drop_index("ix_requests_purged_at_completed_at", table_name="requests")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("purged_at")
    op.drop_table("server_lease")
