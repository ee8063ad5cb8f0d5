"""Plain data that crosses layers: api -> engine -> worker and back.

Arrays are numpy (no torch here) so the HTTP layer and the store never touch tensors; the
worker converts to torch at the edge. Every field mirrors a Tinker wire concept; the wire
codecs in ``tinsmith/api/`` translate to and from these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

LossConfigValue = float | str


@dataclass(frozen=True)
class ProvenanceSpan:
    """A span of a datum's tokens that came from a prompt or a sampled sequence."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class ImageInput:
    """One image of a model input: its bytes, checked on arrival but not yet turned into tokens.

    How many tokens an image becomes is the base model's processor's business, so a model
    input keeps its text tokens and its images apart: the image sits before the text token at
    index ``position`` (``len(tokens)`` = after the last one).
    """

    data: bytes  # encoded image, format checked (decodes fully, within the pixel cap)
    format: str  # "png" | "jpeg" | "webp"
    width: int
    height: int
    position: int
    expected_tokens: int | None  # the client's advisory count; checked against the processor's
    where: str  # wire path of the chunk, for messages: "data[0].model_input[2]"


@dataclass
class Datum:
    """One training example: model input tokens and the loss inputs aligned with them.

    ``loss_inputs`` values are dense arrays whose leading dimension is ``len(tokens)``
    (``target_tokens`` int64 ``(N,)`` or ``(N, K)``; ``weights``, ``advantages``,
    ``logprobs`` float32 of the same shape as the targets, ...).
    """

    tokens: np.ndarray  # int64 (N,)
    loss_inputs: dict[str, np.ndarray]
    model_input_spans: list[ProvenanceSpan] = field(default_factory=list)
    loss_input_spans: list[ProvenanceSpan] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # image chunks between the tokens


@dataclass
class ForwardBackwardInput:
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, LossConfigValue] = field(default_factory=dict)
    forward_only: bool = False
    # For loss_fn "custom": the stored loss that loss_fn_config["loss_id"] names, resolved by the
    # API (a tinsmith.custom_losses.BoundCustomLoss; typed loosely to keep torch out of here).
    custom_loss: Any = None


@dataclass
class ForwardBackwardResult:
    """One output dict per input datum (``logprobs`` always, float32, targets' shape)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        """Raise InvalidInputError naming the first out-of-range field."""
        import math

        from tinsmith.errors import InvalidInputError

        checks = {
            "learning_rate": self.learning_rate >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "eps": self.eps > 0,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise InvalidInputError(f"adam_params.{name}={value!r} is out of range")


@dataclass(frozen=True)
class DimuonParams:
    """One Dimuon step's hyperparameters (``optimizer_params`` with ``type: "dimuon"``); the
    defaults of the two fields the SDK does not send yet are tinsmith's (docs/optimizers.md)."""

    learning_rate: float
    grad_clip_norm: float = 0.0  # non-positive: no clipping
    beta1: float = 0.9
    damping: float = 1.0
    rank_lr_correction_exponent: float = 0.5

    def validate(self) -> None:
        """Raise InvalidInputError naming the first out-of-range field."""
        import math

        from tinsmith.errors import InvalidInputError

        checks = {
            "learning_rate": self.learning_rate >= 0,
            "grad_clip_norm": True,
            "beta1": 0 <= self.beta1 < 1,
            "damping": self.damping > 0,
            "rank_lr_correction_exponent": True,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise InvalidInputError(f"optimizer_params.{name}={value!r} is out of range")


OptimParams = AdamParams | DimuonParams


@dataclass(frozen=True)
class LoraSpec:
    """What the SDK's LoraConfig carries, plus alpha (not exposed by the SDK; default 32)."""

    rank: int
    seed: int | None = None
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    # None: stop at EOS; []: never stop early; strings or token ids otherwise.
    stop: list[str] | list[int] | None = None


@dataclass
class SampleInput:
    prompt: np.ndarray  # int64 (P,)
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool = False
    # (P-1, K) token ids to score at prompt positions 1..P-1; -1 = nothing asked there.
    target_prompt_ids: np.ndarray | None = None
    # The request's sparse CSR layout (crow, col) of those ids, echoed in the result; None = dense.
    target_prompt_csr: tuple[np.ndarray, np.ndarray] | None = None
    prompt_alt_tokens_k: int = 0  # tokens to draw at every prompt position after the first
    prompt_images: list[ImageInput] = field(default_factory=list)  # image chunks of the prompt


@dataclass
class SampledSequence:
    tokens: np.ndarray  # int32 (T,)
    logprobs: np.ndarray  # float32 (T,)
    stop_reason: Literal["stop", "length"]
    topk_token_ids: np.ndarray | None = None  # int32 (T, k)
    topk_logprobs: np.ndarray | None = None  # float32 (T, k)


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None  # float32 (P,), NaN where not computed
    topk_prompt_token_ids: np.ndarray | None = None  # int32 (P, k)
    topk_prompt_logprobs: np.ndarray | None = None  # float32 (P, k)
    prompt_cache_hit_tokens: int = 0
    target_prompt_logprobs: np.ndarray | None = None  # float32 (P-1, K), 0.0 where nothing was asked
    target_prompt_csr: tuple[np.ndarray, np.ndarray] | None = None  # the request's layout, if sparse
    prompt_alt_tokens: np.ndarray | None = None  # int64 (P-1, k) drawn tokens
    prompt_alt_logprobs: np.ndarray | None = None  # float32 (P-1, k) their model logprobs
