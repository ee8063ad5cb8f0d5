"""Custom losses uploaded with create_custom_loss, kept per session so they outlive a restart.

``custom_losses`` holds the SDK's encoded torch.fx graph as sent; ``(session_id,
custom_loss_seq_id)`` is unique because the SDK retries an upload with the same sequence
number. Only an addition.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "custom_losses",
        sa.Column("loss_id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("custom_loss_seq_id", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("graph", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("loss_id", name="pk_custom_losses"),
        sa.UniqueConstraint("session_id", "custom_loss_seq_id", name="uq_custom_losses_session_id_custom_loss_seq_id"),
    )


def downgrade() -> None:
    op.drop_table("custom_losses")
