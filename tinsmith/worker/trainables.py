"""Trainable units that share one base model: LoRA adapters, or the whole model (full fine-tune).

Each unit owns its parameters, its optimizer (AdamW or Dimuon, fixed when the run is created)
with its state, and its accumulated gradients. Stepping one unit touches only its own tensors,
so tenants cannot disturb each other.

Full fine-tuning of a bf16/fp16 model keeps fp32 *master weights*: the model computes with its
half-precision weights, while the optimizer steps an fp32 copy of each (gradients are moved
into fp32 as each backward produces them, so micro-batches accumulate in fp32) and the result
is rounded back into the model after every step. Without it an update smaller than half the
bf16 spacing of a weight (lr 1e-5 on weights of magnitude 0.1) rounds away and training stalls.
Saved state holds the fp32 masters, so a resume continues exactly. LoRA adapters are fp32
tensors already (cast to the activations' dtype inside the matmul), so they need no masters.
"""

from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch.autograd.graph import increment_version

from tinsmith.checkpoints.stored_tensors import in_memory, shape_of
from tinsmith.errors import InvalidInputError
from tinsmith.models.layers import CausalLM
from tinsmith.models.lora import LoraLinear, together_groups
from tinsmith.models.copy_refresh import CopyRefresh
from tinsmith.models.moe import ExpertLinear
from tinsmith.optim import ADAMW, STATE_KEYS, apply_hyperparameters, build_optimizer, check_params_match, steps_on_device
from tinsmith.types import LoraSpec, OptimParams


def squared_grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's squared L2 norm, in fp32, as one ``(n,)`` tensor: one multi-tensor kernel
    on a GPU (``torch._foreach_norm``) rather than a cast and a norm per tensor, which cost a
    tenant's optimizer step ~800 launches on a 28-layer model with every linear layer adapted."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()


@dataclass
class Trainable:
    """One independently optimised set of parameters.

    ``slot`` is the adapter index carried in batch segments (None: the base weights themselves
    are trained, i.e. full fine-tuning).
    """

    slot: int | None
    spec: LoraSpec | None
    named_params: list[tuple[str, torch.Tensor]]
    # (layer, weights) pairs this adapter occupies while resident; empty for full fine-tuning.
    attachments: list = field(default_factory=list)
    optimizer_type: str = ADAMW
    # fp32 master copies, one per entry of ``named_params`` (None: the optimizer steps the
    # parameters themselves, which are fp32 already). See the module docstring.
    masters: list[torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer = field(init=False)
    steps: int = 0
    resident: bool = True
    # The model these parameters live in: told of every change to them (prefix caches key by it).
    model: CausalLM | None = None
    # (attachments, their CopyRefresh) of :meth:`copy_refresh`, made at the first refresh.
    _refresh: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # AdamW's state dict of every tensor of :attr:`params`, in order (:meth:`adamw_state_lists`).
    _adamw_lists: list | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read at every step of every tenant: made once, not a list a call (``named_params``
        # stays what it is for the unit's life).
        self._model_params = [p for _, p in self.named_params]
        rank = self.spec.rank if self.spec is not None else None
        self.optimizer = build_optimizer(self.optimizer_type, self.params, rank)

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The tensors the model computes with (callers must not change the list)."""
        return self._model_params

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, holding the gradients: the fp32 masters when kept."""
        return self.masters if self.masters is not None else self.model_params

    @property
    def named_stepped(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for (n, _), p in zip(self.named_params, self.params)]

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def _weights_changed(self) -> None:
        if self.model is not None:
            self.model.weights_changed(self.slot)

    def park(self, host: torch.device) -> None:
        """Leave the model's layers (freeing a resident slot); tensors, grads and optimizer state
        move to ``host`` memory untouched, so training resumes exactly where it stopped."""
        if not self.resident or self.slot is None:
            return
        for layer, w in self.attachments:
            layer.adapters.pop(self.slot, None)
            w.copies = w.group = None
            if isinstance(layer, LoraLinear):
                layer.forget_stacked_copies()
        self._move(host)
        self.resident = False
        self._weights_changed()

    def unpark(self, device: torch.device) -> None:
        if self.resident or self.slot is None:
            return
        self._move(device)
        for layer, w in self.attachments:
            layer.adapters[self.slot] = w
        self.resident = True
        self._weights_changed()
        self.refresh_compute_copies()

    def refresh_compute_copies(self) -> None:
        """Make the half-precision copies a bf16 model's LoRA layers compute with, and the adapter's
        rows of several tenants' stacks, all at once (one multi-tensor copy, not a cast per tensor
        at each layer's next forward)."""
        refresh = self.copy_refresh()
        if refresh is not None:
            refresh.refresh()

    def copy_refresh(self) -> CopyRefresh | None:
        """What :meth:`refresh_compute_copies` refreshes, and how: by the layers' dtype, the
        weights run in groups (q/k/v, gate/up), those run alone, and every (LoraLinear, weights)
        pair for the tenants' stacks. Worked out once: the layers and the attachments stay what
        they are for the unit's life, and walking the whole model at every step was host time
        that a GPU waited for, once per tenant and step. None for a full fine-tune."""
        if self.slot is None or self.model is None:
            return None
        if self._refresh is not None and self._refresh[0] is self.attachments:
            return self._refresh[1]
        mine = {id(layer): w for layer, w in self.attachments if isinstance(layer, LoraLinear)}
        grouped: dict[torch.dtype, list] = {}
        in_groups: set[int] = set()
        for layers in together_groups(self.model):
            ws = [mine.get(id(layer)) for layer in layers]
            if all(w is not None for w in ws):
                grouped.setdefault(layers[0].weight.dtype, []).append(ws)
                in_groups.update(id(layer) for layer in layers)
        alone: dict[torch.dtype, list] = {}
        for layer, w in self.attachments:
            if id(layer) in mine and id(layer) not in in_groups and layer.weight.dtype != w.A.dtype:
                alone.setdefault(layer.weight.dtype, []).append(w)
        linear = [(layer, w) for layer, w in self.attachments if isinstance(layer, LoraLinear)]
        refresh = CopyRefresh(alone, grouped, linear)
        self._refresh = (self.attachments, refresh)
        return refresh

    def adamw_state_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
        """AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` of every tensor of :attr:`params`, in
        order, once every one has its state (None before). A joint step of several tenants reads
        them at every step, and finding each tensor's state by the tensor (a few hundred a tenant,
        each a Python hash) was host time a GPU waited for: the per-tensor state dicts are kept
        instead, and read afresh each time (whatever replaced a tensor in them, a move between
        devices above all, is what is read). Found again once the dicts themselves are replaced
        (:meth:`import_state`, or whoever left the first or last tensor's not the one kept)."""
        params, state = self.params, self.optimizer.state
        if not params:
            return None
        sts = self._adamw_lists
        if sts is None or len(state) != len(params) or state.get(params[0]) is not sts[0] \
                or state.get(params[-1]) is not sts[-1]:
            sts = [state.get(p) for p in params]
            if not all(sts):
                return None
            self._adamw_lists = sts
        return [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts], [st["step"] for st in sts]

    def _move(self, device: torch.device) -> None:
        steps_too = steps_on_device(self.optimizer)  # fused AdamW's step counts live beside the parameters
        for p in self.params:
            if p.device != device:
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and (k != "step" or steps_too):
                        self.optimizer.state[p][k] = v.to(device)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def take_grads(self) -> list[torch.Tensor | None]:
        """The gradients so far, taken off the parameters (no copy): a backward then fills fresh
        ones, which :meth:`merge_grads` adds these to, or :meth:`restore_grads` drops for these
        (a forward/backward pass, and each of its micro-batches, in case it fails)."""
        taken = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return taken

    def merge_grads(self, taken: list[torch.Tensor | None]) -> None:
        """Add the gradients :meth:`take_grads` took to those of the backward since (one foreach
        add for all, not a kernel per parameter); the same sums as accumulating in place."""
        fresh, earlier = [], []
        for p, g in zip(self.params, taken):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                fresh.append(p.grad)
                earlier.append(g.to(p.grad.device))
        if fresh:
            torch._foreach_add_(fresh, earlier)

    def restore_grads(self, saved: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.params, saved):  # the unit may have been parked or unparked since
            p.grad = None if g is None else g.to(p.device)

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of the weights (the fp32 masters when kept) and of the optimizer state per
        tensor: AdamW's ``NAME.exp_avg``, ``.exp_avg_sq``, ``.step``; Dimuon's ``NAME.momentum``."""
        weights = {n: p.detach().clone() for n, p in self.named_stepped}
        opt: dict[str, torch.Tensor] = {}
        for n, p in self.named_stepped:
            st = self.optimizer.state.get(p)
            if st:
                for key in STATE_KEYS[self.optimizer_type]:
                    opt[f"{n}.{key}"] = st[key].detach().clone()
                if "step" in st:
                    opt[f"{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).clone()
        return weights, opt

    def _has_saved_state(self, optimizer: Mapping[str, torch.Tensor] | None, name: str) -> bool:
        """Does the checkpoint hold optimizer state for tensor ``name`` (it was stepped)?"""
        if optimizer is None:
            return False
        marker = "step" if self.optimizer_type == ADAMW else STATE_KEYS[self.optimizer_type][0]
        return f"{name}.{marker}" in optimizer

    def _check_state(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, torch.Tensor] | None) -> None:
        """Raise unless every tensor (and, where it was stepped, its optimizer state) is there in
        this unit's shape: checked before anything is replaced, so a bad checkpoint changes nothing.
        Shapes are full ones (a DTensor's shape is global)."""
        for n, p in self.named_params:
            got = shape_of(weights, n)  # from a stored checkpoint's header: nothing read yet
            if got != tuple(p.shape):
                raise InvalidInputError(f"checkpoint tensor {n!r} has shape {got}, this run needs {tuple(p.shape)}")
            if self._has_saved_state(optimizer, n):
                for suffix in STATE_KEYS[self.optimizer_type]:
                    if shape_of(optimizer, f"{n}.{suffix}") != tuple(p.shape):
                        raise InvalidInputError(f"checkpoint optimizer state {n}.{suffix} is missing or misshapen")

    def import_state(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, torch.Tensor] | None) -> None:
        """Replace weights (and the optimizer state, or reset it); validates everything first, and
        reads every tensor of a stored checkpoint before replacing any (a file that cannot be read
        changes nothing). ``optimizer`` must come from a run of this unit's optimizer family."""
        self._check_state(weights, optimizer)
        weights, optimizer = in_memory(weights), None if optimizer is None else in_memory(optimizer)
        self.optimizer.state.clear()
        self._adamw_lists = None
        with torch.no_grad():
            for (n, p), model_p in zip(self.named_stepped, self.model_params):
                p.copy_(weights[n].to(p.device, p.dtype))
                p.grad = None
                if model_p is not p:
                    model_p.copy_(p)
                    model_p.grad = None
                if self._has_saved_state(optimizer, n):
                    st = {k: optimizer[f"{n}.{k}"].to(p.device, p.dtype).clone() for k in STATE_KEYS[self.optimizer_type]}
                    if f"{n}.step" in optimizer:
                        step = optimizer[f"{n}.step"].reshape(()).float()
                        st["step"] = step.to(p.device, copy=True) if steps_on_device(self.optimizer) else step.clone()
                    self.optimizer.state[p] = st
        self._weights_changed()  # written in place: cached prompts and adapter banks are stale
        self.refresh_compute_copies()

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of ``params``' gradients (a sharded unit sums its shards' squares)."""
        return squared_grad_norms([p.grad for p in params]).sum().sqrt()

    def step(self, hp: OptimParams) -> dict[str, float]:
        """One optimizer step over this unit only, by its optimizer's own ``step()``; clip by its
        own global grad norm when asked. (The runtime steps plain AdamW units, alone or several
        together, through :mod:`tinsmith.worker.joint_steps` instead: the same pieces and the same
        kernels, without ``step()``'s Python per tensor. This stays the step of every other unit,
        and the reference those are held to.)"""
        check_params_match(self.optimizer_type, hp)
        params = self.stepped_params()
        if not params:
            return dict(SKIPPED_NO_GRAD)
        norm_f = float(self.grad_norm(params))
        self.clip(params, norm_f, hp)
        self.before_step(hp)
        self.optimizer.step()
        self.after_step(params)
        self.refresh_compute_copies()
        return {"grad_norm": norm_f, "learning_rate": hp.learning_rate}

    def stepped_params(self) -> list[torch.Tensor]:
        """The tensors a step moves: those holding a gradient."""
        return [p for p in self.params if p.grad is not None]

    def stepped_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`stepped_params` and their gradients, each gradient read once (a joint step
        of several tenants needs them for the norm, the clip and the update)."""
        params = self.params
        grads = [p.grad for p in params]
        if any(map(operator.is_, grads, repeat(None))):
            kept = [(p, g) for p, g in zip(params, grads) if g is not None]
            return [p for p, _ in kept], [g for _, g in kept]
        return params, grads

    def clip(self, params: list[torch.Tensor], norm: float, hp: OptimParams) -> None:
        """Refuse a non-finite gradient norm (nothing is applied); scale the gradients down to
        ``hp.grad_clip_norm`` when they exceed it."""
        if not math.isfinite(norm):
            raise InvalidInputError(
                "accumulated gradients contain NaN or infinity; the optimizer step was not applied "
                "(check learning rate, weights and advantages)"
            )
        if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
            torch._foreach_mul_([p.grad for p in params], hp.grad_clip_norm / (norm + 1e-6))

    def before_step(self, hp: OptimParams) -> None:
        """What precedes the optimizer's update: the step's hyperparameters on the optimizer's
        groups, and the weights marked changed (a failure half-way must not leave the old
        version standing in caches keyed by it)."""
        apply_hyperparameters(self.optimizer, hp)
        self._weights_changed()

    def after_step(self, params: list[torch.Tensor]) -> None:
        """What follows the optimizer's update of ``params``: gradients dropped, masters rounded
        into the model, the step counted (the compute copies' refresh is the caller's)."""
        if steps_on_device(self.optimizer):
            # The fused kernel writes the parameters without bumping their version counters, and
            # the compute copies (and several tenants' stacks) know a stale copy by its version.
            increment_version(params)
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.masters)  # round the masters into the model
        self._weights_changed()
        self.steps += 1


# What a step of a unit without gradients returns (nothing is applied).
SKIPPED_NO_GRAD = {"grad_norm": 0.0, "skipped_no_grad": 1.0}


def attach_lora(model: CausalLM, slot: int, spec: LoraSpec, optimizer_type: str = ADAMW) -> Trainable:
    """Create adapter ``slot`` on every targeted layer; seeded init is reproducible."""
    seed = spec.seed if spec.seed is not None else secrets.randbits(63)
    gen = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
    named: list[tuple[str, torch.Tensor]] = []
    attachments = []
    for name, layer in model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed):
        w = layer.add_adapter(slot, spec.rank, spec.alpha, gen)
        named += [(f"{name}.lora_A.weight", w.A), (f"{name}.lora_B.weight", w.B)]
        attachments.append((layer, w))
    model.weights_changed(slot)
    trainable = Trainable(slot=slot, spec=spec, named_params=named, attachments=attachments,
                          optimizer_type=optimizer_type, model=model)
    trainable.refresh_compute_copies()
    return trainable


def detach_lora(model: CausalLM, slot: int) -> None:
    for m in model.modules():
        if isinstance(m, (LoraLinear, ExpertLinear)):
            m.remove_adapter(slot)
    model.weights_changed(slot)


def full_model_trainable(model: CausalLM, optimizer_type: str = ADAMW, master_weights: bool = True) -> Trainable:
    """Make every base weight trainable (full fine-tuning of this model instance).

    Half-precision weights get fp32 masters unless ``master_weights`` is False (which exists
    to show what they prevent: small updates rounding away).
    """
    named = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied embeddings appear twice
            continue
        seen.add(id(p))
        p.requires_grad_(True)
        named.append((name, p))
    masters = None
    if master_weights and any(p.dtype != torch.float32 for _, p in named):
        masters = [_master_for(p) for _, p in named]
    model.weights_changed(None)
    return Trainable(slot=None, spec=None, named_params=named, optimizer_type=optimizer_type, masters=masters,
                     model=model)


def _master_for(p: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``p`` that receives ``p``'s gradient, in fp32, after every backward.

    The hook adds each backward's gradient into the master's and clears ``p.grad``, so
    gradient accumulation over micro-batches and requests happens in fp32 and the
    half-precision gradient never outlives one backward.
    """
    master = p.detach().float().clone()

    def move_grad(param: torch.Tensor) -> None:
        g = param.grad
        if g is None:
            return
        if master.grad is None:
            master.grad = g.float()
        else:
            master.grad.add_(g)
        param.grad = None

    p.register_post_accumulate_grad_hook(move_grad)
    return master


def lora_tensors(tr: Trainable) -> dict[str, torch.Tensor]:
    """A detached copy of an adapter's weights under their PEFT-style names."""
    return {name: p.detach().clone() for name, p in tr.named_params}


def install_lora_weights(model: CausalLM, slot: int, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Put frozen adapter weights into ``slot`` (sampler snapshots); checks every name and shape first."""
    from tinsmith.models.lora import LoraWeights

    targets = model.lora_targets(spec.train_attn, spec.train_mlp, spec.train_unembed)
    planned = []
    for name, layer in targets:
        A, B = tensors.get(f"{name}.lora_A.weight"), tensors.get(f"{name}.lora_B.weight")
        if A is None or B is None:
            raise InvalidInputError(f"adapter weights lack {name}.lora_A/lora_B")
        a_shape, b_shape = layer.lora_shapes(spec.rank)
        if tuple(A.shape) != a_shape or tuple(B.shape) != b_shape:
            raise InvalidInputError(
                f"adapter tensor {name} has shapes {tuple(A.shape)}/{tuple(B.shape)}, the model needs {a_shape}/{b_shape}"
            )
        planned.append((layer, A, B))
    device = next(model.parameters()).device
    for layer, A, B in planned:
        layer.adapters[slot] = LoraWeights(A.detach().to(device, torch.float32).clone(),
                                           B.detach().to(device, torch.float32).clone(), spec.alpha / spec.rank)
    model.weights_changed(slot)
