"""Initial schema: sessions, models, requests, sampling sessions, checkpoints.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_heartbeat_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("finish_reason", sa.String(), nullable=True),
        sa.Column("finish_detail", sa.Text(), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("sdk_version", sa.String(), nullable=True),
        sa.Column("project_id", sa.String(), nullable=True),
        sa.Column("display_name", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_owner_created_at", "sessions", ["owner", "created_at"])

    op.create_table(
        "models",
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=True),
        sa.Column("model_seq_id", sa.Integer(), nullable=True),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("is_lora", sa.Boolean(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=True),
        sa.Column("lora_config", sa.JSON(), nullable=True),
        sa.Column("optimizer_config", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_request_at", TS, nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("corrupted", sa.Boolean(), nullable=False),
        sa.Column("last_seq_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("model_id", name="pk_models"),
        sa.CheckConstraint("status IN ('active', 'unloaded', 'lost')", name="ck_models_status"),
    )
    op.create_index("ix_models_session_id", "models", ["session_id"])
    op.create_index("ix_models_owner_created_at", "models", ["owner", "created_at"])
    op.create_index("ix_models_status", "models", ["status"])

    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("sampling_session_id", sa.String(), nullable=True),
        sa.Column("seq_id", sa.BigInteger(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("payload_type", sa.String(), nullable=False),
        sa.Column("submit_info", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_content_type", sa.String(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("request_id", name="pk_requests"),
        sa.UniqueConstraint("model_id", "seq_id", name="uq_requests_model_id_seq_id"),
        sa.UniqueConstraint(
            "sampling_session_id", "seq_id", name="uq_requests_sampling_session_id_seq_id"
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed')", name="ck_requests_status"
        ),
    )
    op.create_index("ix_requests_status_created_at", "requests", ["status", "created_at"])
    op.create_index("ix_requests_completed_at", "requests", ["completed_at"])

    op.create_table(
        "sampling_sessions",
        sa.Column("sampling_session_id", sa.String(), nullable=False),
        sa.Column("session_id", sa.String(), nullable=True),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("model_path", sa.String(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("next_client_counter", sa.Integer(), nullable=False),
        sa.Column("next_sequence_number", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("sampling_session_id", name="pk_sampling_sessions"),
    )
    op.create_index("ix_sampling_sessions_session_id", "sampling_sessions", ["session_id"])

    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("storage_path", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=True),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "kind", "name", name="pk_checkpoints"),
        sa.CheckConstraint(
            "kind IN ('weights', 'sampler_weights', 'external_weights')",
            name="ck_checkpoints_kind",
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'ready', 'failed')", name="ck_checkpoints_status"
        ),
    )
    op.create_index("ix_checkpoints_owner_created_at", "checkpoints", ["owner", "created_at"])
    op.create_index("ix_checkpoints_expires_at", "checkpoints", ["expires_at"])


def downgrade() -> None:
    for table in ("checkpoints", "sampling_sessions", "requests", "models", "sessions"):
        op.drop_table(table)
