"""Request bodies of the JSON endpoints (lenient: unknown keys are ignored, as the SDK adds fields)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from tinsmith.api.codecs._common import INT64_MAX, INT64_MIN
from tinsmith.errors import InvalidInputError
from tinsmith.types import AdamParams, DimuonParams, OptimParams


# Stored in a 32-bit INTEGER column; the SDK counts its training clients from 0.
ModelSeqId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]

# An integer query parameter (limit, offset): one the database can take.
Int64Query = Annotated[int, Query(ge=INT64_MIN, le=INT64_MAX)]


def _nonfinite_at(value: Any, path: str = "") -> str | None:
    """Where a NaN or an infinity is in a value: ``""`` for the value itself, ``"a.b[2]"`` inside
    a free-form object or list; None when there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, v in items:
        found = _nonfinite_at(v, where)
        if found is not None:
            return found
    return None


class Body(BaseModel):
    """Base of every JSON body. Strings were already checked by the parser (no NUL, no lone
    surrogate); numbers are checked here, each refused naming its field rather than failing
    inside the database: an integer wider than 64 bits, and a NaN or an infinity (``NaN``,
    ``Infinity`` or an overflowing ``1e999``), which PostgreSQL refuses in the JSON columns that
    hold free-form objects such as ``user_metadata``, and which no typed field accepts either."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _storable_numbers(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{value} does not fit in a signed 64-bit integer")
        where = _nonfinite_at(value)
        if where is not None:
            raise ValueError(f"{where or 'the value'} is NaN or infinite; only finite numbers are accepted")
        return value


class ClientConfigRequest(Body):
    sdk_version: str | None = None


class CreateSessionRequest(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(Body):
    session_id: str


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(Body):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class LoraConfigBody(Body):
    rank: int = Field(default=32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(Body):
    session_id: str
    model_seq_id: ModelSeqId
    base_model: str = Field(min_length=1)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: dict[str, Any] | None = None


class CreateCustomLossRequest(Body):
    """``create_custom_loss``; ``inputs`` and ``graph`` are checked by tinsmith.custom_losses."""

    session_id: str = Field(min_length=1)
    custom_loss_seq_id: int = Field(ge=0)
    name: str
    inputs: list[Any]
    graph: dict[str, Any]


class ModelIdRequest(Body):
    model_id: str = Field(min_length=1)


_ADAM_ONLY = ("beta2", "eps", "weight_decay")
_DIMUON_ONLY = ("damping", "rank_lr_correction_exponent")


class OptimParamsBody(Body):
    """``adam_params`` (AdamParams: no ``type``) or ``optimizer_params`` (``type: "dimuon"``).

    Every field is optional here so the defaults can be the family's own; :meth:`to_params`
    picks the family, checks no field of the other one was sent, and fills the defaults."""

    type: str | None = None
    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = None
    damping: float | None = None
    rank_lr_correction_exponent: float | None = None

    def to_params(self) -> OptimParams:
        from tinsmith.optim import ADAMW, DIMUON, SUPPORTED_OPTIMIZERS

        kind = ADAMW if self.type in (None, "adam") else self.type
        if kind not in SUPPORTED_OPTIMIZERS:
            raise InvalidInputError(f"optimizer_params.type {self.type!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_OPTIMIZERS)})")
        field_prefix, foreign = ("optimizer_params", _ADAM_ONLY) if kind == DIMUON else ("adam_params", _DIMUON_ONLY)
        for name in foreign:
            if getattr(self, name) is not None:
                raise InvalidInputError(f"{field_prefix}.{name} does not apply to the {kind} optimizer")
        sent = {k: v for k, v in self.model_dump(exclude={"type"}).items() if v is not None}
        if kind == DIMUON:
            if "learning_rate" not in sent:
                raise InvalidInputError("optimizer_params.learning_rate is required for dimuon")
            return DimuonParams(**sent)
        return AdamParams(**sent)


class OptimStepRequest(Body):
    model_id: str = Field(min_length=1)
    seq_id: int | None = Field(default=None, ge=0)
    params: OptimParamsBody = Field(validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params"))


class UnloadModelRequest(Body):
    model_id: str = Field(min_length=1)
    seq_id: int | None = None


class FuturesTarget(Body):
    """What a ``retrieve_futures`` poll watches: one (possibly cloned) sampling client."""

    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = Field(min_length=1)
    # seq_ids of clone c lie in [c * 1e9, (c + 1) * 1e9), which must fit in 64 bits.
    cloned_sampler_id: int = Field(0, ge=0, le=INT64_MAX // 1_000_000_000 - 1)


class RetrieveFuturesRequest(Body):
    target: FuturesTarget
    prev_cursor: int = Field(0, ge=0)
    timeout: float | None = Field(None, ge=0, le=3600)  # seconds; the server caps it at --long-poll-seconds
    retrieved_request_ids: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=100_000)


class CancelFutureRequest(Body):
    request_id: str = Field(min_length=1)


class RetrieveFutureRequest(Body):
    request_id: str = Field(min_length=1)
    allow_metadata_only: bool = False
