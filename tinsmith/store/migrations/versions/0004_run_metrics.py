"""run_metrics: each training run's metric history (loss and friends per step), for the dashboard.

Also indexes ``models`` by last activity (the dashboard lists runs most recently active first).
Only additions: a new table and indexes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "run_metrics",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_run_metrics"),
    )
    op.create_index("ix_run_metrics_model_id_id", "run_metrics", ["model_id", "id"])
    op.create_index("ix_models_owner_last_request_at", "models", ["owner", "last_request_at"])
    op.create_index("ix_models_last_request_at", "models", ["last_request_at"])


def downgrade() -> None:
    op.drop_index("ix_models_last_request_at", table_name="models")
    op.drop_index("ix_models_owner_last_request_at", table_name="models")
    op.drop_index("ix_run_metrics_model_id_id", table_name="run_metrics")
    op.drop_table("run_metrics")
