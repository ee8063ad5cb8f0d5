"""The training runtime: one base model, many trainable units, batched forward/backward.

A worker call carries requests from many tenants (each names its unit: a LoRA adapter slot or
the full-model unit). Every request is validated on its own first; a bad one fails alone and
the rest still run together in shared micro-batches. Gradients accumulate in each unit's
tensors until that unit's ``optim_step``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from tinsmith.errors import CapacityError, InvalidInputError, NotFoundError, TinsmithError
from tinsmith.losses import LossBatch, LossSpec, resolve_loss, validate_inputs
from tinsmith.models.layers import CausalLM
from tinsmith.models.lora import Segments
from tinsmith.types import AdamParams, ForwardBackwardInput, ForwardBackwardResult, LoraSpec
from tinsmith.worker.batching import MicroBatch, SequenceRef, build_micro_batch, plan_micro_batches
from tinsmith.worker.trainables import Trainable, attach_lora, detach_lora, full_model_trainable

FULL_UNIT = 0  # unit id of the whole-model trainable in full fine-tuning mode

# Above this many logits (tokens x vocab) per micro-batch, logprobs are computed in chunks whose
# logits are recomputed in backward instead of stored.
LOGIT_CHUNK_ELEMENTS = 1 << 25


@dataclass
class TrainRequest:
    unit: int
    input: ForwardBackwardInput


@dataclass
class _Prepared:
    """A validated request, with its datums converted to tensors once."""

    unit: Trainable
    unit_id: int
    spec: LossSpec
    config: dict
    forward_only: bool
    tokens: list[np.ndarray]
    targets: list[torch.Tensor]  # (N,) or (N, K) int64
    inputs: list[dict[str, torch.Tensor]]  # flattened float inputs per datum


def slice_segments(segs: Segments, a: int, b: int) -> Segments:
    """The part of ``segs`` inside rows [a, b), rebased to start at 0."""
    out: Segments = []
    for slot, s, e in segs:
        lo, hi = max(s, a), min(e, b)
        if lo < hi:
            out.append((slot, lo - a, hi - a))
    return out


class TrainingRuntime:
    """Owns the model's trainable units and runs batched forward/backward and optimizer steps."""

    def __init__(
        self,
        model: CausalLM,
        *,
        max_lora_adapters: int = 16,
        max_lora_rank: int = 128,
        max_training_runs: int = 256,
        micro_batch_tokens: int = 16384,
        micro_batch_seqs: int = 1 << 30,
        gradient_checkpointing: bool = False,
        full_finetune: bool = False,
    ):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.max_lora_adapters = max_lora_adapters  # adapters attached to the model at once
        self.max_training_runs = max_training_runs  # adapters held at all (the rest parked in host memory)
        self.max_lora_rank = max_lora_rank
        self.micro_batch_tokens = micro_batch_tokens
        self.micro_batch_seqs = micro_batch_seqs
        model.gradient_checkpointing = gradient_checkpointing
        self.full_finetune = full_finetune
        self.units: dict[int, Trainable] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident LoRA units, least recently used first
        self._unit_ids = itertools.count()
        self.host = torch.device("cpu")
        if full_finetune:
            self.units[FULL_UNIT] = full_model_trainable(model)

    # ----------------------------------------------------------------------------- units
    def create_adapter(self, spec: LoraSpec) -> int:
        """Allocate a LoRA slot for ``spec`` and return its unit id."""
        if self.full_finetune:
            raise InvalidInputError("this model instance is a full fine-tune; it does not take LoRA adapters")
        if not (1 <= spec.rank <= self.max_lora_rank):
            raise CapacityError(f"lora_config.rank={spec.rank} is outside 1..{self.max_lora_rank} (server --max-lora-rank)")
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise InvalidInputError("lora_config must train at least one of attn, mlp, unembed")
        if len(self.units) >= self.max_training_runs:
            raise CapacityError(
                f"this base model already holds {self.max_training_runs} training runs (server --max-training-runs); "
                "unload a model or finish a session first"
            )
        self._make_room(1, keep=set())
        unit = next(self._unit_ids)
        self.units[unit] = attach_lora(self.model, unit, spec)
        self.lru[unit] = None
        return unit

    # ----------------------------------------------------------------------------- residency
    def _make_room(self, needed: int, keep: set[int]) -> None:
        """Park least recently used adapters until ``needed`` more can be attached."""
        while len(self.lru) + needed > self.max_lora_adapters:
            victim = next((u for u in self.lru if u not in keep), None)
            if victim is None:
                raise CapacityError(f"more than {self.max_lora_adapters} adapters needed at once")
            self.units[victim].park(self.host)
            del self.lru[victim]

    def ensure_resident(self, units: set[int]) -> None:
        """Attach every adapter in ``units`` (parking others if needed) and mark them recently used."""
        missing = [u for u in units if u not in self.lru and self.units[u].slot is not None]
        if missing:
            self._make_room(len(missing), keep=units)
            for u in missing:
                self.units[u].unpark(self.device)
                self.lru[u] = None
        for u in units:
            if u in self.lru:
                self.lru.move_to_end(u)

    def delete_adapter(self, unit: int) -> None:
        if unit in self.units and self.units[unit].slot is not None:
            detach_lora(self.model, unit)
            del self.units[unit]
            self.lru.pop(unit, None)

    def unit(self, unit: int) -> Trainable:
        try:
            return self.units[unit]
        except KeyError:
            raise NotFoundError(f"no trainable unit {unit} on this model") from None

    # ----------------------------------------------------------------------------- validation
    def _prepare(self, req: TrainRequest) -> _Prepared:
        unit = self.unit(req.unit)
        inp = req.input
        spec, config = resolve_loss(inp.loss_fn, inp.loss_fn_config)
        if not inp.data:
            raise InvalidInputError("data must contain at least one datum")
        V, ctx = self.config.vocab_size, self.config.max_position_embeddings
        toks, targets, inputs = [], [], []
        for i, d in enumerate(inp.data):
            t = np.asarray(d.tokens)
            if t.ndim != 1 or t.size == 0:
                raise InvalidInputError(f"data[{i}].model_input must hold at least one token")
            if t.size > ctx:
                raise InvalidInputError(f"data[{i}].model_input has {t.size} tokens, above the model's context of {ctx}")
            if not np.issubdtype(t.dtype, np.integer) or t.min() < 0 or t.max() >= V:
                raise InvalidInputError(f"data[{i}].model_input has token ids outside [0, {V}) (vocab size {V})")
            shapes = {k: tuple(np.shape(v)) for k, v in d.loss_inputs.items()}
            tshape = shapes.get("target_tokens")
            if tshape is not None and (not tshape or tshape[0] != t.size):
                rows = tshape[0] if tshape else 0
                raise InvalidInputError(
                    f"data[{i}].loss_fn_inputs['target_tokens'] has {rows} rows but model_input has {t.size} tokens"
                )
            validate_inputs(spec, i, d.loss_inputs, shapes)
            tgt = np.asarray(d.loss_inputs["target_tokens"])
            if not np.issubdtype(tgt.dtype, np.integer) or tgt.min() < 0 or tgt.max() >= V:
                raise InvalidInputError(f"data[{i}].loss_fn_inputs['target_tokens'] has ids outside [0, {V})")
            flat = {}
            for k, v in d.loss_inputs.items():
                if k == "target_tokens" or k not in spec.required_inputs + spec.optional_inputs:
                    continue
                arr = np.asarray(v, dtype=np.float32)
                if not np.isfinite(arr).all():
                    raise InvalidInputError(f"data[{i}].loss_fn_inputs[{k!r}] contains NaN or infinite values")
                flat[k] = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1))).to(self.device)
            for k in spec.optional_inputs:  # absent optional inputs take their neutral value
                if k == "weights" and k not in flat:
                    flat[k] = torch.ones(tgt.size, dtype=torch.float32, device=self.device)
            toks.append(t.astype(np.int64, copy=False))
            targets.append(torch.from_numpy(tgt.astype(np.int64, copy=False)))
            inputs.append(flat)
        return _Prepared(unit, req.unit, spec, config, inp.forward_only, toks, targets, inputs)

    # ----------------------------------------------------------------------------- forward/backward
    def forward_backward(self, requests: list[TrainRequest]) -> list[Union[ForwardBackwardResult, TinsmithError]]:
        """Run many requests together. Returns, per request, its result or the error that rejected it."""
        results: list[Union[ForwardBackwardResult, TinsmithError, None]] = [None] * len(requests)
        prepared: dict[int, _Prepared] = {}
        for r, req in enumerate(requests):
            try:
                prepared[r] = self._prepare(req)
            except TinsmithError as e:
                results[r] = e
        for wave in self._waves(prepared):
            for r, res in self._run(wave).items():
                results[r] = res
        return results  # type: ignore[return-value]

    def _waves(self, prepared: dict[int, _Prepared]) -> list[dict[int, _Prepared]]:
        """Split requests so no call needs more adapters attached than there are resident slots."""
        waves: list[dict[int, _Prepared]] = []
        units: set[int] = set()
        for r, p in prepared.items():
            uid = p.unit_id
            if not waves or (uid not in units and len(units) >= self.max_lora_adapters and p.unit.slot is not None):
                waves.append({})
                units = set()
            waves[-1][r] = p
            units.add(uid)
        return waves

    def _run(self, prepared: dict[int, _Prepared]) -> dict[int, ForwardBackwardResult]:
        self.ensure_resident({p.unit_id for p in prepared.values() if p.unit.slot is not None})
        seqs = [
            SequenceRef(r, d, p.unit.slot, len(t), needs_grad=not p.forward_only)
            for r, p in prepared.items()
            for d, t in enumerate(p.tokens)
        ]
        lps: dict[tuple[int, int], torch.Tensor] = {}
        grad_units = {id(p.unit): p.unit for p in prepared.values() if not p.forward_only}
        saved = {k: u.snapshot_grads() for k, u in grad_units.items() if u.slot is not None}
        try:
            for rows in plan_micro_batches(seqs, self.micro_batch_tokens, self.micro_batch_seqs):
                mb = build_micro_batch(rows, [prepared[s.request].tokens[s.datum] for s in rows], self.device)
                self._run_micro_batch(mb, prepared, lps)
        except BaseException:
            for k, g in saved.items():
                grad_units[k].restore_grads(g)
            raise
        return {r: self._finish(p, [lps[(r, d)] for d in range(len(p.tokens))]) for r, p in prepared.items()}

    def _run_micro_batch(self, mb: MicroBatch, prepared: dict[int, _Prepared], lps: dict) -> None:
        with torch.set_grad_enabled(mb.needs_grad):
            hidden = self.model.hidden_states(mb.tokens, mb.positions, mb.row_segments)
            h = hidden[mb.valid]  # (T, hidden) real tokens, row-major
            rows_idx, cols, elem_bounds = [], [], [0]
            for i, ref in enumerate(mb.rows):
                tgt = prepared[ref.request].targets[ref.datum]
                n = tgt.shape[0]
                k = 1 if tgt.dim() == 1 else tgt.shape[1]
                rows_idx.append(torch.arange(mb.token_offsets[i], mb.token_offsets[i] + n).repeat_interleave(k))
                cols.append(tgt.reshape(-1))
                elem_bounds.append(elem_bounds[-1] + n * k)
            lp = self._target_logprobs(h, mb.token_segments, torch.cat(rows_idx).to(self.device), torch.cat(cols).to(self.device))
            losses = []
            by_request: dict[int, list[int]] = {}
            for i, ref in enumerate(mb.rows):
                lps[(ref.request, ref.datum)] = lp[elem_bounds[i] : elem_bounds[i + 1]]
                by_request.setdefault(ref.request, []).append(i)
            if mb.needs_grad:
                for r, idxs in by_request.items():
                    p = prepared[r]
                    parts = [lps[(r, mb.rows[i].datum)] for i in idxs]
                    batch = self._loss_batch(p, [mb.rows[i].datum for i in idxs], parts)
                    losses.append(p.spec.fn(batch).loss)
                torch.stack(losses).sum().backward()
        for i, ref in enumerate(mb.rows):
            lps[(ref.request, ref.datum)] = lps[(ref.request, ref.datum)].detach()

    def _target_logprobs(self, h: torch.Tensor, segs: Segments, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """log p(cols[e] | token rows[e]) for each element e, without keeping huge logits around."""
        T, V = h.shape[0], self.config.vocab_size
        if T * V <= LOGIT_CHUNK_ELEMENTS:
            return _gather_logprobs(self.model, h, segs, rows, cols)
        chunk = max(1, LOGIT_CHUNK_ELEMENTS // V)
        out = []
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            ea, eb = torch.searchsorted(rows, torch.tensor([a, b], device=rows.device)).tolist()
            if ea == eb:
                continue
            fn = _gather_logprobs
            args = (self.model, h[a:b], slice_segments(segs, a, b), rows[ea:eb] - a, cols[ea:eb])
            out.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
        return torch.cat(out)

    def _loss_batch(self, p: _Prepared, datums: list[int], lps: list[torch.Tensor]) -> LossBatch:
        offsets = [0]
        for x in lps:
            offsets.append(offsets[-1] + x.numel())
        keys = p.inputs[datums[0]].keys()
        inputs = {k: torch.cat([p.inputs[d][k] for d in datums]) for k in keys}
        return LossBatch(torch.cat(lps), inputs, offsets, p.config)

    def _finish(self, p: _Prepared, lps: list[torch.Tensor]) -> ForwardBackwardResult:
        """Outputs and metrics over the whole request, from detached logprobs (micro-batching invariant)."""
        with torch.no_grad():
            out = p.spec.fn(self._loss_batch(p, list(range(len(lps))), lps))
        outputs = []
        a = 0
        for d, lp in enumerate(lps):
            shape = tuple(p.targets[d].shape)
            b = a + lp.numel()
            outputs.append(
                {
                    "logprobs": lp.float().cpu().numpy().reshape(shape),
                    "elementwise_loss": out.elementwise[a:b].float().cpu().numpy().reshape(shape),
                }
            )
            a = b
        return ForwardBackwardResult(outputs=outputs, metrics=out.metrics)

    # ----------------------------------------------------------------------------- optimizer
    def optim_step(self, unit: int, params: AdamParams) -> dict[str, float]:
        params.validate()
        tr = self.unit(unit)
        if tr.slot is not None:
            self.ensure_resident({unit})
        return tr.step(params)

    def has_pending_grads(self, unit: int) -> bool:
        return self.unit(unit).has_grads()


def _gather_logprobs(model: CausalLM, h: torch.Tensor, segs: Segments, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    logits = model.logits(h, segs)
    lse = torch.logsumexp(logits, dim=-1)
    return logits[rows, cols] - lse[rows]
