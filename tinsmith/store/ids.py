"""Identifier formats, kept in one place because the SDK computes some of them itself.

``model_id`` must be ``{session_id}:train:{model_seq_id}``: the SDK builds that string on its
own for ``create_training_client_from_state*`` and then calls the server with it.
"""

from __future__ import annotations

import uuid


def new_session_id() -> str:
    return str(uuid.uuid4())


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def custom_loss_id_for(session_id: str, custom_loss_seq_id: int) -> str:
    return f"{session_id}:loss:{custom_loss_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"
