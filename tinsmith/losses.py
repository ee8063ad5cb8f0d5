"""Every training loss as a pure function of per-token logprobs and the datum's loss inputs.

Conventions shared by all losses (they match the Tinker service):

* Inputs are *flat*: the elements of all datums of one request concatenated, in datum order;
  ``offsets[i]:offsets[i+1]`` are datum ``i``'s elements. For a ``(N, K)`` target the K
  columns of each row are consecutive (row-major).
* The loss is a plain **sum** over elements (no averaging); clients fold any normalisation
  into ``weights`` or ``advantages``.
* Metrics are named ``name:reduction``; ``loss:sum`` is always present.

Each loss's formula is in its docstring; ``logp`` is the trained model's logprob of the target
token, ``q`` the sampler's logprob (input ``logprobs``), ``A`` the advantage, ``w`` a weight,
``r = exp(logp - q)`` the importance ratio and ``sg`` stop-gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from tinsmith.errors import InvalidInputError
from tinsmith.transfers import to_device


@dataclass
class LossBatch:
    logprobs: torch.Tensor  # (E,) float32, differentiable
    inputs: Mapping[str, torch.Tensor]  # each (E,), same layout as logprobs
    offsets: list[int]  # datum boundaries, len = num_datums + 1
    config: Mapping[str, float | str]
    # Losses that read each datum's inputs in their own shapes (custom losses): per datum of the
    # batch, its inputs and its targets' shape. Built-in losses read the flat ``inputs`` instead.
    datum_inputs: list[dict[str, torch.Tensor]] | None = None
    datum_shapes: list[tuple[int, ...]] | None = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    elementwise: torch.Tensor | None  # (E,); None for a loss that is not a sum over elements
    # The metrics, or how to read them: they are read from the device on first use, so the
    # backward pass, which takes only ``loss``, never waits for them.
    metrics_source: dict[str, float] | Callable[[], dict[str, float]] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        if callable(self.metrics_source):
            self.metrics_source = self.metrics_source()
        return self.metrics_source


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[LossBatch], LossOutput]
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    allows_2d_targets: bool = False


def _metrics(out: torch.Tensor, **extra: torch.Tensor | float) -> Callable[[], dict[str, float]]:
    """How to read the loss's sum and ``extra`` metrics (see :attr:`LossOutput.metrics_source`)."""
    return functools.partial(_read_metrics, out, **extra)


def _read_metrics(out: torch.Tensor, **extra: torch.Tensor | float) -> dict[str, float]:
    """The loss's sum and ``extra`` metrics as floats, read from the device at once."""
    names = ["loss:sum"] + [k.replace("__", ":") for k in extra]
    values = [out.detach().sum()] + [v.detach() if isinstance(v, torch.Tensor) else float(v) for v in extra.values()]
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    read = torch.stack([values[i].to(out.device, torch.float64).reshape(()) for i in on_device]).tolist()
    for i, x in zip(on_device, read):
        values[i] = x
    return {name: float(v) for name, v in zip(names, values)}


def cross_entropy(b: LossBatch) -> LossOutput:
    """``loss = sum(-logp * w)``; ``w`` defaults to 1; targets may be ``(N,)`` or ``(N, K)``."""
    w = b.inputs.get("weights")
    el = -b.logprobs if w is None else -b.logprobs * w
    return LossOutput(el.sum(), el, _metrics(el))


def _ratio(b: LossBatch) -> torch.Tensor:
    return torch.exp(b.logprobs - b.inputs["logprobs"])


def _sampled_mean(x: torch.Tensor, b: LossBatch) -> torch.Tensor:
    """Mean over sampled positions (sampler logprob known, i.e. != 0): RL datums send 0 for the
    prompt, where a ratio means nothing and would drag the average down."""
    sampled = b.inputs["logprobs"] != 0
    # A masked sum over a count, not x[sampled].mean(): indexing by a mask (and asking whether
    # any is set) would read from the device. No sampled position: 0.
    total = torch.where(sampled, x.detach(), torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / sampled.sum().clamp(min=1).to(total.dtype)


def importance_sampling(b: LossBatch) -> LossOutput:
    """``loss = -sum(r * A)`` with ``r = exp(logp - q)`` (REINFORCE with an importance weight)."""
    r = _ratio(b)
    el = -r * b.inputs["advantages"]
    return LossOutput(el.sum(), el, _metrics(el, ratio__mean=_sampled_mean(r, b)))


def ppo(b: LossBatch) -> LossOutput:
    """``loss = -sum(min(r * A, clip(r, lo, hi) * A))``; ``lo``/``hi`` are absolute ratio bounds
    (``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2 by default)."""
    lo, hi = float(b.config["clip_low_threshold"]), float(b.config["clip_high_threshold"])
    r, A = _ratio(b), b.inputs["advantages"]
    el = -torch.minimum(r * A, r.clamp(lo, hi) * A)
    clipped = ((r < lo) | (r > hi)).float()
    return LossOutput(el.sum(), el, _metrics(el, clip_fraction__mean=clipped.mean() if r.numel() else 0.0))


def cispo(b: LossBatch) -> LossOutput:
    """``loss = -sum(sg(clip(r, lo, hi)) * A * logp)`` (defaults ``lo`` 0, ``hi`` 4)."""
    lo, hi = float(b.config["clip_low_threshold"]), float(b.config["clip_high_threshold"])
    r = _ratio(b)
    el = -(r.clamp(lo, hi).detach() * b.inputs["advantages"] * b.logprobs)
    return LossOutput(el.sum(), el, _metrics(el))


def dro(b: LossBatch) -> LossOutput:
    """``loss = -sum(logp * A - beta/2 * (logp - q)^2)`` (quadratic penalty keeps it near the sampler).

    Positions whose sampler logprob ``q`` is exactly 0 carry no penalty: that is how RL datums
    mark tokens that were not sampled (the prompt), whose logprobs nobody recorded.
    """
    beta = float(b.config["beta"])
    q = b.inputs["logprobs"]
    d = torch.where(q != 0, b.logprobs - q, torch.zeros_like(q))
    el = -(b.logprobs * b.inputs["advantages"] - 0.5 * beta * d * d)
    return LossOutput(el.sum(), el, _metrics(el))


def _datum_of_position(offsets: list[int], device: torch.device) -> torch.Tensor:
    """Each position's datum index, made on the host from its boundaries and copied without a
    wait (on the device, ``repeat_interleave`` by the lengths would read their sum back first)."""
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    return to_device(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths), device)


def _segment_sum(x: torch.Tensor, seg: torch.Tensor, datums: int) -> torch.Tensor:
    """Per-datum sums of a flat tensor whose positions belong to the datums ``seg`` names."""
    return torch.zeros(datums, dtype=x.dtype, device=x.device).index_add(0, seg, x)


def gspo(b: LossBatch) -> LossOutput:
    """Group Sequence Policy Optimization: one importance ratio per sequence.

    For datum ``i`` with mask ``m`` (input ``sequence_ratio_mask``: which tokens enter the ratio),
    ``s_i = exp(sum_t m_t (logp_t - q_t) / sum_t m_t)`` (the geometric-mean token ratio), and
    ``loss = -sum_i sum_t m_t min(s_i A_t, clip(s_i, lo, hi) A_t) / sum_t m_t``: each sequence
    contributes its clipped surrogate once (with a constant advantage per sequence this is the
    GSPO objective). Bounds are absolute ratios, defaults ``1 - 3e-4`` and ``1 + 4e-4``.
    """
    lo, hi = float(b.config["clip_low_threshold"]), float(b.config["clip_high_threshold"])
    m = b.inputs["sequence_ratio_mask"]
    A = b.inputs["advantages"]
    seg, datums = _datum_of_position(b.offsets, m.device), len(b.offsets) - 1
    count = _segment_sum(m, seg, datums).clamp(min=1.0)
    log_s = _segment_sum(m * (b.logprobs - b.inputs["logprobs"]), seg, datums) / count
    s = torch.exp(log_s)[seg]
    el = -m * torch.minimum(s * A, s.clamp(lo, hi) * A) / count[seg]
    clipped = ((torch.exp(log_s) < lo) | (torch.exp(log_s) > hi)).float()
    return LossOutput(el.sum(), el, _metrics(el, clip_fraction__mean=clipped.mean() if clipped.numel() else 0.0))


def stable_reinforce(b: LossBatch) -> LossOutput:
    """Truncated importance-sampling REINFORCE against the server's own sampling logprobs.

    ``w_t = sg(clip(exp(logp_t - q_t), lo, hi))`` and ``loss = -sum_t w_t A_t logp_t``, with
    ``lo`` = ``clip_low_threshold`` (default 0) and ``hi`` = ``clip_high_threshold`` (default 2).
    ``q_t`` is the logprob the server itself recorded when it sampled token ``t``
    (``record_stability_info``), found through the datum's sampled provenance spans; positions
    the server has no record of use the client's ``logprobs`` input. Using the server's record
    keeps the ratio exact even when the client's copy of the logprobs was rounded or stale.
    """
    lo, hi = float(b.config["clip_low_threshold"]), float(b.config["clip_high_threshold"])
    r = _ratio(b)
    w = r.clamp(lo, hi).detach()
    el = -(w * b.inputs["advantages"] * b.logprobs)
    truncated = ((r < lo) | (r > hi)).float()
    return LossOutput(el.sum(), el, _metrics(
        el, ratio__mean=_sampled_mean(r, b), truncated_fraction__mean=_sampled_mean(truncated, b)))


LOSSES: dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec("cross_entropy", cross_entropy, ("target_tokens",), ("weights",), allows_2d_targets=True),
        LossSpec("importance_sampling", importance_sampling, ("target_tokens", "logprobs", "advantages")),
        LossSpec(
            "ppo",
            ppo,
            ("target_tokens", "logprobs", "advantages"),
            config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
        LossSpec(
            "cispo",
            cispo,
            ("target_tokens", "logprobs", "advantages"),
            config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ),
        LossSpec("dro", dro, ("target_tokens", "logprobs", "advantages"), config_defaults={"beta": 0.1}),
        LossSpec(
            "gspo",
            gspo,
            ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
            config_defaults={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
        ),
        LossSpec(
            "stable_reinforce",
            stable_reinforce,
            ("target_tokens", "logprobs", "advantages"),
            config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 2.0},
        ),
    )
}

def inputs_read_by(loss_fn: str) -> frozenset[str] | None:
    """The loss inputs a built-in loss reads; ``None`` for a name that is not a loss here.

    Every other key a datum carries (``mask``, or ``advantages`` passed along to
    ``cross_entropy`` by a recipe) is accepted and ignored, as the hosted service does: only
    the keys a loss reads are checked for shape and type.
    """
    spec = LOSSES.get(loss_fn)
    return None if spec is None else frozenset(spec.required_inputs + spec.optional_inputs)


def resolve_loss(name: str, config: Mapping[str, float | str]) -> tuple[LossSpec, dict[str, float | str]]:
    """The loss spec and its full config (defaults filled in); rejects unknown names and keys."""
    spec = LOSSES.get(name)
    if spec is None:
        raise InvalidInputError(f"loss_fn {name!r} is not supported; supported: {', '.join(sorted(LOSSES))}")
    unknown = sorted(set(config) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.config_defaults)) or "none"
        raise InvalidInputError(f"loss_fn_config keys {unknown} are not used by {name!r} (allowed: {allowed})")
    full: dict[str, float | str] = dict(spec.config_defaults)
    for k, v in config.items():
        if isinstance(v, str):
            raise InvalidInputError(f"loss_fn_config[{k!r}] must be a number for {name!r}, got the string {v!r}")
        full[k] = float(v)
    return spec, full


def validate_inputs(spec: LossSpec, index: int, inputs: Mapping[str, object], shapes: Mapping[str, tuple]) -> None:
    """Check one datum's loss inputs against the loss: required keys present, and every input
    the loss reads shaped like ``target_tokens``. Keys the loss does not read are ignored.
    ``index`` names the datum in messages."""
    missing = [k for k in spec.required_inputs if k not in inputs]
    if missing:
        raise InvalidInputError(f"data[{index}].loss_fn_inputs lacks {missing} required by loss_fn {spec.name!r}")
    tshape = shapes["target_tokens"]
    if len(tshape) == 2 and not spec.allows_2d_targets:
        raise InvalidInputError(f"data[{index}].loss_fn_inputs['target_tokens'] must be 1-D for loss_fn {spec.name!r}")
    if len(tshape) not in (1, 2):
        raise InvalidInputError(f"data[{index}].loss_fn_inputs['target_tokens'] must be 1-D or 2-D, got shape {tshape}")
    for k in spec.required_inputs + spec.optional_inputs:
        if k == "target_tokens" or k not in inputs:
            continue
        if tuple(shapes[k]) != tuple(tshape):
            raise InvalidInputError(
                f"data[{index}].loss_fn_inputs[{k!r}] has shape {tuple(shapes[k])}, target_tokens has {tuple(tshape)}"
            )
