"""What the model-family tests share: transformers' reference model, our logits, one training call."""

from __future__ import annotations

import torch
import transformers

from tinsmith.types import ForwardBackwardInput
from tinsmith.worker.runtime import TrainRequest


def reference_model(model_dir):
    """transformers' model in fp32; eager experts are its reference loop (grouped kernels reorder sums)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             experts_implementation="eager")


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """Our model's logits for ``tokens`` (b, L) at positions 0..L-1, base weights only."""
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model.logits(model.hidden_states(tokens, pos))


def cross_entropy_step(rt, unit, data):
    """One cross_entropy forward_backward of ``data`` on ``unit``; its result (raised if it failed)."""
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", {}, False))])
    if isinstance(res, Exception):
        raise res
    return res
