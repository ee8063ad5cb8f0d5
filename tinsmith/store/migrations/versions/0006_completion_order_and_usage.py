"""Completion order of sampling requests (retrieve_futures cursors) and per-key usage buckets.

* ``sampling_sessions.completions``: how many of the sampler's requests have finished; each
  finishing request takes the next number in the same transaction that stores its outcome.
* ``requests.completion_seq``: that number. A ``retrieve_futures`` cursor is one of them, so
  cursors stay valid across a server restart, and commits of one sampler are serialized by the
  counter row, so no completion can appear behind a cursor already handed out.
* ``usage``: tokens per API key, UTC hour, kind (training, sampling_prefill[_cached], sampling_sample),
  base model and session, added to in batches.

Only additions: no table is rewritten.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("completions", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("completion_seq", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_requests_sampling_session_id_completion_seq", "requests", ["sampling_session_id", "completion_seq"]
    )
    op.create_table(
        "usage",
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("bucket_start", TS, nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("owner", "bucket_start", "kind", "base_model", "session_id", name="pk_usage"),
    )


def downgrade() -> None:
    op.drop_table("usage")
    op.drop_index("ix_requests_sampling_session_id_completion_seq", table_name="requests")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("completion_seq")
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("completions")
