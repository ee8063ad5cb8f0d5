"""How large one request may be: the bounds the API checks before it stores or allocates anything.

Each bound is a server option; a request beyond one is refused with a 400 whose message names
the field, the bound and the option that sets it. The defaults never refuse what the SDK sends
in normal use: the SDK splits every forward_backward/forward call into requests of at most
1024 datums and about 5 MB (and this server advertises its own bounds in ``client/config``, so
the SDK splits within them); sampling bounds follow the sampler and the model's context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinsmith.api.codecs._images import DEFAULT_MAX_IMAGE_PIXELS
from tinsmith.errors import InvalidInputError
from tinsmith.types import SampleInput

if TYPE_CHECKING:
    from tinsmith.server.config import ServerConfig
    from tinsmith.server.state import ServerState

CONTEXT = "the model's context length"

# What the SDK estimates a forward_backward request to weigh at the least, per token (4 bytes of
# token id); it starts a new request before the estimate passes ``fwdbwd_max_chunk_bytes_count``.
SDK_MIN_BYTES_PER_TOKEN = 4
SDK_DEFAULT_CHUNK_BYTES = 5_000_000


def refuse_above(what: str, amount: int, limit: int, source: str) -> None:
    """400 when ``amount`` exceeds ``limit``; ``source`` says what sets the limit (an option, the model)."""
    if amount > limit:
        raise InvalidInputError(f"{what} is {amount}, above this server's limit of {limit} ({source})")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; ``None`` for a token bound means the served model's context length."""

    num_samples: int
    sample_tokens: int | None
    prompt_tokens: int | None
    forward_datums: int
    forward_tokens: int
    dense_elements: int  # what the sparse tensors of one request may expand to, in all
    image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image in a model input

    @classmethod
    def of(cls, config: ServerConfig, sampling_rows: int) -> RequestLimits:
        """The limits a server runs with; ``sampling_rows`` is its sampler's row limit (num_samples' bound)."""
        return cls(num_samples=sampling_rows, sample_tokens=config.max_sample_tokens,
                   prompt_tokens=config.max_prompt_tokens, forward_datums=config.max_forward_datums,
                   forward_tokens=config.max_forward_tokens, dense_elements=config.max_body_bytes // 4,
                   image_pixels=config.max_image_pixels)

    def check_sample(self, inp: SampleInput, context_length: int) -> None:
        """Refuse a sampling request whose sizes exceed a limit (before any id is reserved)."""
        refuse_above("num_samples", inp.num_samples, self.num_samples, "set by --max-num-samples")
        if inp.params.max_tokens is not None:
            limit, source = _within_context(self.sample_tokens, context_length, "--max-sample-tokens")
            refuse_above("sampling_params.max_tokens", inp.params.max_tokens, limit, source)
        limit, source = _within_context(self.prompt_tokens, context_length, "--max-prompt-tokens")
        refuse_above("the prompt length", len(inp.prompt), limit, source)

    def check_forward_datums(self, datums: int) -> None:
        """Refuse a forward_backward/forward request with too many datums (checked first: counting
        the tokens walks every datum)."""
        refuse_above("the number of datums in data", datums, self.forward_datums, "set by --max-forward-datums")

    def check_forward_tokens(self, tokens: int) -> None:
        """Refuse a forward_backward/forward request with too many model_input tokens, all datums together."""
        refuse_above("the number of model_input tokens in data", tokens, self.forward_tokens,
                     "set by --max-forward-tokens")

    def sdk_chunking(self) -> dict[str, int]:
        """``client/config`` keys that make the SDK split forward_backward calls within these limits."""
        return {
            "fwdbwd_max_chunk_len": self.forward_datums,
            "fwdbwd_max_chunk_bytes_count": min(SDK_DEFAULT_CHUNK_BYTES, SDK_MIN_BYTES_PER_TOKEN * self.forward_tokens),
        }


def _within_context(option: int | None, context_length: int, flag: str) -> tuple[int, str]:
    """The binding bound of an option capped by the model's context length, and its source."""
    if option is None or option >= context_length:
        return context_length, CONTEXT
    return option, f"set by {flag}"


def limits_of(state: ServerState) -> RequestLimits:
    """The limits of a running server (its config and its sampler's row limit)."""
    return RequestLimits.of(state.config, state.worker.options.max_sampling_rows)
