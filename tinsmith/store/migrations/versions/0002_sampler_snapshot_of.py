"""Samplers remember which training run's in-memory snapshot they read.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("snapshot_of", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("snapshot_of")
