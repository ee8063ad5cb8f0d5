"""A custom loss as one more loss of the batched forward/backward.

The runtime treats it like a built-in loss (:class:`tinsmith.losses.LossSpec`): it gets the
logprobs of the request's datums in a micro-batch and returns the summed loss, whose gradient
flows back into the trainable unit like any other. The differences are that each datum's
inputs keep their own shape (a custom input may be a scalar, ``[T]`` or ``[T, K]``, not
necessarily the targets' shape) and that the loss runs once per datum, as the SDK's
``forward_backward_custom`` does on the client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tinsmith.custom_losses.interpreter import RunLimits, run_loss, warm_up
from tinsmith.custom_losses.program import CustomLoss
from tinsmith.errors import InvalidInputError
from tinsmith.losses import LossBatch, LossOutput, LossSpec


@dataclass(frozen=True)
class BoundCustomLoss:
    """A stored custom loss with the limits it runs under: what a ``loss_fn: "custom"`` request
    carries from the API to the worker (one per request).

    ``limits.timeout_s`` bounds the wall clock of every run of the loss for the request together
    (its check, its micro-batches, its final metrics), so no request holds the shared worker
    longer than that, however many datums it has.
    """

    loss_id: str
    loss: CustomLoss
    limits: RunLimits
    _spent_s: list[float] = field(default_factory=lambda: [0.0], compare=False, repr=False)

    @contextmanager
    def _deadline(self) -> Iterator[float]:
        """The deadline of one run, from what is left of the request's time; counts the run's time."""
        warm_up()  # torch's one-time set-up is not the loss's time
        start = time.monotonic()
        try:
            yield start + self.limits.timeout_s - self._spent_s[0]
        finally:
            self._spent_s[0] += time.monotonic() - start

    def spec(self) -> LossSpec:
        return LossSpec("custom", self._run, ("target_tokens",) + self.loss.input_names, allows_2d_targets=True)

    def datum_inputs(self, index: int, inputs: Mapping[str, np.ndarray], target_shape: tuple[int, ...],
                     device: torch.device) -> dict[str, torch.Tensor]:
        """One datum's inputs as tensors of their declared ranks; refuses a missing input or a
        rank that differs from the loss's declaration, naming the datum and key."""
        if len(target_shape) != self.loss.inputs[0].rank:
            raise InvalidInputError(
                f"data[{index}].loss_fn_inputs['target_tokens'] has rank {len(target_shape)}, but custom loss "
                f"{self.loss.name!r} declared logprobs with rank {self.loss.inputs[0].rank}"
            )
        out = {}
        for x in self.loss.inputs[1:]:
            where = f"data[{index}].loss_fn_inputs[{x.name!r}]"
            if x.name not in inputs:
                raise InvalidInputError(f"{where} is missing; custom loss {self.loss.name!r} reads it")
            arr = np.asarray(inputs[x.name])
            if x.rank == 0:
                if arr.size != 1:
                    raise InvalidInputError(f"{where} must hold one value (rank 0), got shape {arr.shape}")
                arr = arr.reshape(())
            elif arr.ndim != x.rank:
                raise InvalidInputError(f"{where} has rank {arr.ndim}, but custom loss {self.loss.name!r} declared rank {x.rank}")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise InvalidInputError(f"{where} contains NaN or infinite values")
            out[x.name] = torch.from_numpy(arr.copy()).to(device)  # (ascontiguousarray makes 0-d 1-d)
        return out

    def check_runs(self, index: int, inputs: dict[str, torch.Tensor], target_shape: tuple[int, ...],
                   device: torch.device) -> None:
        """Run the loss and its backward on one datum with stand-in logprobs before the request
        joins a shared batch: whatever the graph cannot do with these shapes fails here, for this
        request alone, instead of failing the micro-batch it would share with other tenants."""
        logprobs = torch.full(target_shape, -1.0, device=device, requires_grad=True)
        with torch.enable_grad(), self._deadline() as deadline:
            try:
                loss, _ = run_loss(self.loss, [logprobs, *(inputs[n] for n in self.loss.input_names)], device,
                                   self.limits, deadline)
            except InvalidInputError as e:
                raise InvalidInputError(f"data[{index}]: {e}") from None
            if not loss.requires_grad:
                raise InvalidInputError(
                    f"custom loss {self.loss.name!r} does not depend on logprobs (it returned a detached "
                    "or constant loss), so it has no gradient to train on"
                )
            try:
                loss.backward()
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0][:300]
                raise InvalidInputError(f"custom loss {self.loss.name!r} cannot be differentiated: {first}") from None

    def _run(self, b: LossBatch) -> LossOutput:
        assert b.datum_inputs is not None and b.datum_shapes is not None
        with self._deadline() as deadline:
            return self._run_until(b, deadline)

    def _run_until(self, b: LossBatch, deadline: float) -> LossOutput:
        assert b.datum_inputs is not None and b.datum_shapes is not None
        device = b.logprobs.device
        total: torch.Tensor | None = None
        sums: dict[str, float] = {}
        for d, (inputs, shape) in enumerate(zip(b.datum_inputs, b.datum_shapes, strict=True)):
            logprobs = b.logprobs[b.offsets[d]: b.offsets[d + 1]].reshape(shape)
            loss, metrics = run_loss(self.loss, [logprobs, *(inputs[n] for n in self.loss.input_names)], device,
                                     self.limits, deadline)
            loss = loss.to(b.logprobs.dtype)
            total = loss if total is None else total + loss
            for key, value in metrics.items():
                v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                sums[key] = sums.get(key, 0.0) + v
        assert total is not None
        n = len(b.datum_inputs)
        metrics_out = {"loss:sum": float(total.detach())}
        metrics_out.update({k: v / n if k.endswith(":mean") else v for k, v in sums.items()})
        return LossOutput(total, None, metrics_out)
