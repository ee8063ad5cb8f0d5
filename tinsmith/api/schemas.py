"""Request bodies of the JSON endpoints (lenient: unknown keys are ignored, as the SDK adds fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelIdRequest(Body):
    model_id: str = Field(min_length=1)


class AdamParamsBody(Body):
    type: str | None = None
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(Body):
    model_id: str = Field(min_length=1)
    seq_id: int | None = Field(default=None, ge=0)
    params: AdamParamsBody = Field(validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params"))


class UnloadModelRequest(Body):
    model_id: str = Field(min_length=1)
    seq_id: int | None = None


class RetrieveFutureRequest(Body):
    request_id: str = Field(min_length=1)
    allow_metadata_only: bool = False
