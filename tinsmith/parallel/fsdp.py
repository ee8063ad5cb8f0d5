"""Sharded full fine-tuning: data parallelism over FSDP2 (``torch.distributed.fsdp.fully_shard``).

A full fine-tune in one process keeps the whole model, its fp32 master weights and AdamW's two
moments on one device: 16 bytes per parameter before activations. Here every rank of a
data-parallel group keeps ``1/world`` of each (parameters, gradients and optimizer state are
sharded along their first dimension), all-gathers one decoder layer's weights just before it
runs, and reduce-scatters its gradients after its backward.

Every rank receives the same requests (as under tensor parallelism, see
:mod:`tinsmith.parallel.spmd`); each validates them alike, runs its own share of the datums
(:func:`split_datums`), and the per-datum logprobs are all-gathered so that every rank finishes
every request exactly as one process would (loss, metrics, outputs in datum order). Tinker losses
are sums over datums, so the gradient of a request is the sum of the ranks' gradients: the
reduce-scatter sums (FSDP's default divides by the world size, which would be a mean).

FSDP runs a collective per sharded module per forward and backward, so every rank must run the
same number of micro-batches, with and without backward alike: a rank with fewer datums runs
padding micro-batches (one token, zero loss weight) whose gradients are exactly zero.

Parameters stay fp32 (the sharded masters); on a GPU the forward and backward compute in bf16
(``MixedPrecisionPolicy``: bf16 all-gathers, fp32 gradient reduction), on a CPU in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from tinsmith.checkpoints.stored_tensors import rows_of
from tinsmith.errors import InvalidInputError, TinsmithError
from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import load_model
from tinsmith.models.lora import LoraLinear
from tinsmith.optim import ADAMW, DIMUON, STATE_KEYS, check_params_match
from tinsmith.parallel.group import ParallelError, TPGroup, guarded, portable
from tinsmith.parallel.partition import chunk_rows, longest_first
from tinsmith.parallel.sharded_dimuon import FsdpDimuon
from tinsmith.parallel.sharded_save import SaveSource, save_sharded
from tinsmith.types import OptimParams
from tinsmith.worker.batching import SequenceRef, build_micro_batch, plan_micro_batches
from tinsmith.worker.runtime import FULL_UNIT, TrainingRuntime, TrainRequest, _Prepared
from tinsmith.worker.trainables import Trainable, squared_grad_norms

log = logging.getLogger(__name__)
PAD_KEY = ("pad", 0)  # the request key of padding micro-batches


# ----------------------------------------------------------------------------- sharding the model
def unpack_weights(model: CausalLM) -> None:
    """Undo :func:`~tinsmith.models.lora.pack_weights` before sharding.

    The packed q/k/v and gate/up weights are transposed column views of one buffer, and
    ``fully_shard`` refuses non-contiguous parameters. Each weight becomes a contiguous tensor
    of its own and the packed buffers are dropped (kept, they would hold a whole copy of the
    weights on every rank next to the shards). Training runs the layers unpacked anyway.
    """
    for m in model.modules():
        for attr in ("packed_qkv", "packed_gate_up", "packed_in"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)
        if isinstance(m, LoraLinear):
            for name in ("weight", "bias"):
                p = getattr(m, name)
                if p is not None and (not p.is_contiguous()
                                      or p.untyped_storage().nbytes() != p.numel() * p.element_size()):
                    setattr(m, name, nn.Parameter(p.detach().contiguous().clone(), requires_grad=p.requires_grad))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _trainable_fp32(module: nn.Module) -> None:
    """Make ``module``'s parameters not sharded yet fp32 and trainable, in place (ties kept)."""
    for p in module.parameters():
        if not isinstance(p, DTensor):
            if p.dtype != torch.float32:
                p.data = p.data.float()
            p.requires_grad_(True)


def _sum_gradients(module: FSDPModule) -> None:
    """Reduce gradients as sums over ranks, not FSDP's default mean."""
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(1.0)
    else:  # its older name
        module.set_reduce_scatter_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        # a plain SUM collective (gloo has no pre-multiplied sum; with NCCL it avoids a scaling kernel)
        module.set_force_sum_reduction_for_comms(True)


def shard_full_model(model: CausalLM, dp: TPGroup, compute_dtype: torch.dtype | None = None,
                     device: torch.device | None = None) -> CausalLM:
    """Shard ``model`` (in place) over the data-parallel group: one FSDP unit per decoder layer,
    and the root (embedding, final norm, LM head) as one more. Weights become fp32 trainable
    shards; ``compute_dtype`` (default: bf16 on CUDA, fp32 otherwise) is what forward and
    backward compute in. Every rank must hold the same whole model beforehand, on ``device``
    (default: where its parameters are) or in host memory, from which FSDP moves each layer to
    ``device`` as it shards it (the whole model never sits on the device)."""
    unpack_weights(model)
    sharding = FullSharding(dp, device if device is not None else next(model.parameters()).device, compute_dtype)
    for layer in model.model.layers:
        sharding.layer(layer)
    return sharding.root(model)


def load_full_shard(model_dir: str, dp: TPGroup, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """This rank's FSDP shard of a full fine-tune of the checkpoint at ``model_dir``, each decoder
    layer sharded as soon as it is read (the files memory-mapped): a rank never holds more than
    one whole layer in host memory, whatever the checkpoint stores whole per layer (stacked or
    dequantised experts)."""
    sharding = FullSharding(dp, device)
    model = load_model(model_dir, "cpu", dtype, pack=False,
                       on_layer=lambda m, i: sharding.layer(m.model.layers[i])).model
    return sharding.root(model)


class FullSharding:
    """How a full fine-tune's modules become FSDP units over ``dp``: its mesh and precision."""

    def __init__(self, dp: TPGroup, device: torch.device, compute_dtype: torch.dtype | None = None):
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dp = dp
        self.mesh = init_device_mesh(device.type, (dp.size,))
        self.mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)

    def layer(self, layer: nn.Module) -> None:
        """One decoder layer becomes fp32 and is sharded (its whole fp32 copy freed), so a half
        precision model never exists whole in fp32."""
        _trainable_fp32(layer)
        fully_shard(layer, mesh=self.mesh, mp_policy=self.mp)

    def root(self, model: CausalLM) -> CausalLM:
        """The rest (embedding, final norm, LM head) as the root unit, once every layer is sharded."""
        _trainable_fp32(model)
        for p in model.parameters():  # the layers' shards too (a load may have frozen them since)
            p.requires_grad_(True)
        # The runtime calls ``hidden_states`` rather than ``forward``, then reads the LM head's
        # weight for the chunked logprobs: the root stays gathered after its forward so that it
        # reads the gathered weight (and its gradient reaches the root's reduce-scatter); the
        # runtime reshards everything at the end of each call.
        fully_shard(model, mesh=self.mesh, mp_policy=self.mp, reshard_after_forward=False)
        register_fsdp_forward_method(model, "hidden_states")
        for m in model.modules():
            if isinstance(m, FSDPModule):
                _sum_gradients(m)
        model.fsdp_group = self.dp  # type: ignore[attr-defined]
        return model


def reshard_all(model: nn.Module) -> None:
    """Free every gathered weight, so the next forward gathers the current shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------- splitting the work
def split_datums(lengths: list[int], world: int) -> list[list[int]]:
    """Which datums (indices into ``lengths``) each rank runs: longest first onto the rank with
    the fewest tokens so far (:func:`~tinsmith.parallel.partition.longest_first`)."""
    return longest_first(lengths, world)


def plan_ranks(refs: list[SequenceRef], world: int, max_tokens: int, max_seqs: int,
               packed: bool = False) -> list[list[list[SequenceRef]]]:
    """Every rank's micro-batches for ``refs`` (each rank computes all of them, alike), bounded by
    real tokens when ``packed``."""
    shares = split_datums([ref.length for ref in refs], world)
    return [plan_micro_batches([refs[i] for i in share], max_tokens, max_seqs, packed) for share in shares]


def phase_counts(plan: list[list[SequenceRef]]) -> dict[bool, int]:
    """How many of a rank's micro-batches run backward (True) and forward only (False)."""
    return {g: sum(1 for mb in plan if mb[0].needs_grad == g) for g in (True, False)}


# ----------------------------------------------------------------------------- the trainable
@dataclass
class ShardedFullTrainable(Trainable):
    """The whole model as one unit whose tensors are FSDP shards (DTensors).

    ``export_state`` / ``import_state`` speak full-size tensors (every rank must call them), so
    checkpoints are those of a one-process full fine-tune, whatever the group size. Exported
    tensors are in host memory, gathered one at a time.
    """

    dp: TPGroup = TPGroup.single()
    # Whether every rank keeps what it exports (each gathers every tensor either way). A server
    # reads rank 0's only: the others drop each tensor once gathered, rather than each holding the
    # whole state in host memory.
    export_everywhere: bool = True

    @property
    def keeps_exports(self) -> bool:
        return self.export_everywhere or self.dp.rank == 0

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        sq = squared_grad_norms([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]).sum()
        if self.dp.size > 1:
            guarded(self.dp, "gradient-norm all_reduce", lambda: dist.all_reduce(sq))
        return sq.sqrt()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimizer_type == DIMUON:  # whole matrices, each computed by one rank of the group
            self.optimizer = FsdpDimuon(self.params, self.dp, rank=None)

    def step(self, hp: OptimParams) -> dict[str, float]:
        check_params_match(self.optimizer_type, hp)
        try:
            return super().step(hp)
        except RuntimeError as exc:
            if isinstance(exc, (ParallelError, TinsmithError)):
                raise
            raise ParallelError(f"data-parallel optimizer step failed on rank {self.dp.rank}: {exc}") from exc

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights: dict[str, torch.Tensor] = {}
        opt: dict[str, torch.Tensor] = {}
        keep = self.keeps_exports
        for n, p in self.named_stepped:
            weights[n] = _full(p, self.dp, n)
            st = self.optimizer.state.get(p)
            if st:
                for key in STATE_KEYS[self.optimizer_type]:
                    opt[f"{n}.{key}"] = _full(st[key], self.dp, f"{n}.{key}")
                if "step" in st:
                    opt[f"{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).clone()
            if not keep:  # gathered (the collective needs every rank), not kept
                weights.clear()
                opt.clear()
        return weights, opt

    def save_sources(self) -> list[SaveSource]:
        """Every tensor a training-state checkpoint holds, as this rank sees it (shards), named
        ``weights/NAME`` and ``optimizer/NAME.KEY``: what :func:`save_sharded` gathers, in the
        same order on every rank."""
        out = [SaveSource(f"weights/{n}", p.detach()) for n, p in self.named_stepped]
        for n, p in self.named_stepped:
            st = self.optimizer.state.get(p)
            if st:
                out += [SaveSource(f"optimizer/{n}.{key}", st[key]) for key in STATE_KEYS[self.optimizer_type]]
                if "step" in st:
                    out.append(SaveSource(f"optimizer/{n}.step",
                                          torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).clone()))
        return out

    def import_state(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, torch.Tensor] | None) -> None:
        """Full-size tensors in, this rank's rows kept. From a stored checkpoint
        (:class:`~tinsmith.checkpoints.stored_tensors.StoredTensors`) each rank reads only its
        rows of each tensor. Everything is checked and read before anything is replaced, and the
        ranks agree that every one of them could read its part: a checkpoint one rank cannot read
        changes nothing anywhere, and fails alike on every rank."""
        self._check_state(weights, optimizer)  # everything first, in full shapes
        keys = STATE_KEYS[self.optimizer_type]
        mine: dict[str, torch.Tensor] = {}
        failed: Exception | None = None
        try:
            for n, p in self.named_params:
                mine[n] = _my_rows(weights, n, p)
                if self._has_saved_state(optimizer, n):
                    mine.update({f"{n}.{k}": _my_rows(optimizer, f"{n}.{k}", p) for k in keys})
                    if f"{n}.step" in optimizer:
                        mine[f"{n}.step"] = optimizer[f"{n}.step"].reshape(()).float().clone()
        except InvalidInputError as exc:  # a stored checkpoint's file this rank could not read
            failed = exc
        self._agree_read(failed)
        self.optimizer.state.clear()
        self._adamw_lists = None
        with torch.no_grad():
            for n, p in self.named_params:
                _local(p).copy_(mine.pop(n))
                p.grad = None
                if self._has_saved_state(optimizer, n):
                    st = {k: _shard_of(mine.pop(f"{n}.{k}"), p) for k in keys}
                    if f"{n}.step" in mine:
                        st["step"] = mine.pop(f"{n}.step")
                    self.optimizer.state[p] = st
        self._weights_changed()

    def _agree_read(self, failed: Exception | None) -> None:
        """Raise alike on every rank when any rank could not read its part of a checkpoint."""
        ok = torch.tensor([failed is None], dtype=torch.int32, device=_local(self.params[0]).device)
        if self.dp.size > 1:
            guarded(self.dp, "agreeing the checkpoint was read", lambda: dist.all_reduce(ok, op=dist.ReduceOp.MIN))
        if failed is not None:
            log.error("rank %d of %d could not read its part of a checkpoint: %s", self.dp.rank, self.dp.size, failed)
        if not bool(ok.item()):
            raise InvalidInputError("the checkpoint could not be read on every data-parallel rank (they must share "
                                    "the filesystem that holds the checkpoints; the server log names the file)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor, dp: TPGroup, what: str) -> torch.Tensor:
    """The whole tensor in host memory: one gathered tensor at a time is on the device."""
    if not isinstance(t, DTensor):
        return t.detach().to("cpu", copy=True)
    return guarded(dp, f"gather of {what}", lambda: t.detach().full_tensor().to("cpu", copy=True))


def _my_rows(tensors: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of tensor ``name`` laid out as ``like`` (a DTensor split along dimension
    0; a plain tensor takes it whole), on ``like``'s device and in its dtype; only those rows are
    read from a stored checkpoint."""
    if isinstance(like, DTensor):
        rows = chunk_rows(like.shape[0], like.device_mesh.size())
        start = sum(rows[: like.device_mesh.get_local_rank()])
        part = rows_of(tensors, name, start, start + rows[like.device_mesh.get_local_rank()])
    else:
        part = tensors[name]
    return part.to(_local(like).device, like.dtype).clone()


def _shard_of(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's rows, from :func:`_my_rows`) as a tensor laid out as ``like``."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def sharded_full_trainable(model: CausalLM, dp: TPGroup, optimizer_type: str = ADAMW) -> ShardedFullTrainable:
    named, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:  # tied embeddings appear twice
            seen.add(id(p))
            named.append((name, p))
    # ``model``: steps and loads bump its weights version, which tells an inflight sampler's whole
    # copy of the weights (and the prefix cache over it) that it is stale.
    return ShardedFullTrainable(slot=None, spec=None, named_params=named, optimizer_type=optimizer_type, dp=dp,
                                model=model)


# ----------------------------------------------------------------------------- the runtime
class FsdpTrainingRuntime(TrainingRuntime):
    """The training runtime of one data-parallel rank of a sharded full fine-tune.

    Every rank is called with the same requests; results come out the same on every rank.
    :meth:`forward_backward` runs whole calls; the engine's :meth:`begin` / :meth:`advance`
    interleaving runs a chunk of datums per call, chosen alike on every rank and split between
    them. A custom loss runs per datum, each rank on its share; one that is refused on the real
    logprobs (on any rank) fails its pass on every rank, the lowest rank's error naming it.
    """

    def __init__(self, model: CausalLM, **kwargs):
        if kwargs.pop("full_finetune", True) is False:
            raise InvalidInputError("the data-parallel runtime trains the whole model")
        optimizer_type = kwargs.pop("full_optimizer", ADAMW)
        kwargs.pop("master_weights", None)
        super().__init__(model, full_finetune=False, **kwargs)
        self.dp: TPGroup = model.fsdp_group  # type: ignore[attr-defined]
        self.full_finetune = True
        self.oom_retry = False  # a retried half micro-batch would run collectives the other ranks do not
        self.backward_always = True  # every rank joins every backward's reduce-scatters
        self.units[FULL_UNIT] = sharded_full_trainable(model, self.dp, optimizer_type)

    def advance(self, quotas, on_done=None, budget=None) -> None:
        """Run one chunk: its datums chosen as one process would (alike on every rank), each rank
        its share; passes whose datums have all run complete after the chunk (every rank alike).
        A failure fails the chunk's passes; a failed collective is raised too (the group is then
        unusable, which the worker reports)."""
        chosen, involved = self._choose(quotas, budget)
        if not chosen:
            return
        by_id = {p.id: p for p in involved}
        prepared = {(p.id, r): prep for p in involved for r, prep in p.prepared.items()}
        try:
            lps, refused = self._run_share(chosen, prepared)
        except Exception as exc:
            exc = self._as_group_error(exc)
            for p in involved:
                p.fail(exc)
            if isinstance(exc, ParallelError):
                raise exc
            return
        finally:
            reshard_all(self.model)
        for pid, exc in refused.items():
            by_id[pid].fail(exc)  # type: ignore[arg-type]
        for ((pid, r), d), lp in lps.items():
            if not by_id[pid].done:
                by_id[pid].lps[(r, d)] = lp
        for p in involved:
            if not p.done and not p.todo:
                p.complete()
                if on_done is not None:
                    on_done(p)

    def _as_group_error(self, exc: Exception) -> Exception:
        """FSDP's collectives raise backend errors (gloo) when a peer is gone or late: those
        become :class:`ParallelError`."""
        if not isinstance(exc, (ParallelError, TinsmithError)) and isinstance(exc, RuntimeError):
            return ParallelError(f"data-parallel forward/backward failed on rank {self.dp.rank} of {self.dp.size} "
                                 f"({type(exc).__name__}: {str(exc)[:300]}); when another rank exits, raises or "
                                 f"does not join within {self.dp.timeout_s:g} s, the collectives fail so")
        return exc

    def forward_backward(self, requests: list[TrainRequest]) -> list:
        """Run the requests (every rank its share of their datums) and return, per request, its
        result (the same on every rank) or the error that refused it. A failed collective fails
        every valid request with :class:`ParallelError`; the group is then unusable."""
        results: list = [None] * len(requests)
        prepared: dict = {}
        for r, req in enumerate(requests):
            try:
                prepared[("req", r)] = self._prepare(req)
            except TinsmithError as exc:  # every rank refuses alike: the same requests, the same checks
                results[r] = exc
        refs = [SequenceRef(key, d, None, len(t), needs_grad=not prep.forward_only, padded=bool(prep.images[d]))
                for key, prep in prepared.items() for d, t in enumerate(prep.tokens)]
        try:
            lps, refused = self._run_share(refs, prepared)
        except Exception as exc:
            reshard_all(self.model)
            exc = self._as_group_error(exc)
            for key in prepared:
                results[key[1]] = exc
            return results
        reshard_all(self.model)
        if refused:  # the requests are one pass, as in one process: a refused custom loss fails them all
            for key in prepared:
                results[key[1]] = refused["req"]
            return results
        for key, prep in prepared.items():
            try:
                results[key[1]] = self._finish(prep, [lps[(key, d)] for d in range(len(prep.tokens))])
            except TinsmithError as exc:
                results[key[1]] = exc
        return results

    def _run_share(self, refs: list[SequenceRef], prepared: dict) -> tuple[dict, dict]:
        """Run this rank's share of ``refs`` (padded to the group's micro-batch counts) and
        all-gather every datum's logprobs and the passes whose custom loss was refused. Returns
        ``{(request key, datum): logprobs}`` for all, and ``{pass: error}`` (the lowest rank's)."""
        plans = plan_ranks(refs, self.dp.size, self.micro_batch_tokens, self.micro_batch_seqs,
                           self.sized_by_real_tokens)
        # every rank pads each phase (with backward, then forward only) to the most micro-batches of any rank
        counts = {g: max(phase_counts(plan)[g] for plan in plans) for g in (True, False)}
        mine = plans[self.dp.rank]
        pad_prep = self._pad_prepared()
        local: dict = {}
        refused: dict = {}
        all_prepared = {**prepared, PAD_KEY: pad_prep}
        for g in (True, False):
            groups = [mb for mb in mine if mb[0].needs_grad == g]
            groups += [[SequenceRef(PAD_KEY, 0, None, 1, needs_grad=g)]] * (counts[g] - len(groups))
            for rows in groups:
                mb = build_micro_batch(rows, [all_prepared[s.request].tokens[s.datum] for s in rows], self.device,
                                       self.packing)
                # an image-text model's images: each rank encodes those of its own rows
                images = [all_prepared[s.request].images[s.datum] for s in mb.rows]
                out: dict = {}
                for pid, exc in self._run_micro_batch(mb, all_prepared, out, images).items():
                    refused.setdefault(pid, portable(exc))
                local.update({k: v.float().cpu() for k, v in out.items() if k[0] != PAD_KEY})
        gathered: list = [None] * self.dp.size
        if self.dp.size > 1:
            guarded(self.dp, "logprobs all_gather_object", lambda: dist.all_gather_object(gathered, (local, refused)))
        else:
            gathered = [(local, refused)]
        merged: dict = {}
        errors: dict = {}
        for part, fails in gathered:
            merged.update({k: v.to(self.device) for k, v in part.items()})
            for pid, exc in fails.items():
                errors.setdefault(pid, exc)
        return merged, errors

    def _pad_prepared(self) -> _Prepared:
        """A one-token cross-entropy datum with zero weight: its gradient is exactly zero."""
        from tinsmith.losses import resolve_loss

        spec, config = resolve_loss("cross_entropy", {})
        one = torch.zeros(1, dtype=torch.float32, device=self.device)
        return _Prepared(self.units[FULL_UNIT], FULL_UNIT, spec, config, False, [np.zeros(1, dtype=np.int64)],
                         [torch.zeros(1, dtype=torch.int64)], [{"weights": one}], [[]], False)

    def optim_step(self, unit: int, params: OptimParams) -> dict[str, float]:
        reshard_all(self.model)
        return super().optim_step(unit, params)

    def held_elements(self) -> dict[str, int]:
        """Elements this rank holds of the weights, their gradients and the optimizer state, and
        of the whole model (every rank holds about ``1/world`` of each)."""
        tr = self.unit(FULL_UNIT)
        params = [_local(p) for p in tr.params]
        state = [_local(v) for st in tr.optimizer.state.values() for k, v in st.items() if k != "step"]
        return {"weights": sum(p.numel() for p in params),
                "grads": sum(_local(p.grad).numel() for p in tr.params if p.grad is not None),
                "optimizer": sum(t.numel() for t in state),
                "model": sum(p.numel() for p in tr.params)}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights at full size in host memory, under a one-process full
        fine-tune's names (all ranks call it; each gets them, or only rank 0 when the unit does not
        export everywhere), for sampler snapshots and exports."""
        tr = self.unit(FULL_UNIT)
        out = {}
        for n, p in tr.named_params:
            full = _full(p, self.dp, n)
            if tr.keeps_exports:  # type: ignore[attr-defined]
                out[n] = full
        return out

    def gather_weights_into(self, target: CausalLM | None) -> None:
        """The whole weights written into ``target`` in place (all ranks call it; only the rank
        holding the whole model passes one, the others pass None). Each weight is gathered on the
        device and copied straight into the target, one at a time: no host round trip, and no more
        than one whole tensor beside the target at once. What an inflight sampler of a sharded
        full fine-tune reads (the live weights, refreshed after each step or load)."""
        tr = self.unit(FULL_UNIT)
        dest = None if target is None else dict(target.named_parameters())  # a tied head appears once in both
        with torch.no_grad():
            for n, p in tr.named_params:
                full = guarded(self.dp, f"gather of {n}", lambda p=p: p.detach().full_tensor()) \
                    if isinstance(p, DTensor) else p.detach()
                if dest is not None:
                    dest[n].copy_(full)
                del full
        if target is not None:
            target.weights_changed(None)  # prompts cached over the old weights are stale

    def export_full_state(self, unit: int = FULL_UNIT) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Full-size weights and optimizer state (all ranks call it; each gets them)."""
        return self.unit(unit).export_state()

    def import_full_state(self, unit: int, weights: dict[str, torch.Tensor],
                          optimizer: dict[str, torch.Tensor] | None) -> None:
        self.unit(unit).import_state(weights, optimizer)
        reshard_all(self.model)

    # Sharded checkpoint writes (all ranks call them; see tinsmith.parallel.sharded_save). The
    # most bytes of full-size tensors the last save held at once on this rank, for measurement.
    last_save_peak_bytes: int = 0

    def state_bytes(self, unit: int = FULL_UNIT) -> int:
        """The tensor bytes a training-state checkpoint of ``unit`` holds, from shapes alone."""
        return sum(s.nbytes for s in self.unit(unit).save_sources())  # type: ignore[attr-defined]

    def weights_bytes(self, unit: int = FULL_UNIT) -> int:
        """The tensor bytes of the whole weights (a Hugging Face export), from shapes alone."""
        return sum(p.numel() * p.element_size() for p in self.unit(unit).params)

    def save_state_sharded(self, unit: int, directory: str, header: dict, what: str) -> int:
        """Write the training state to ``directory`` from every rank, each its own tensors
        (format 2 of :mod:`tinsmith.checkpoints.state_format`); rank 0's bytes committed."""
        from tinsmith.checkpoints.state_format import commit_sharded_state, write_state_part

        def write(tmp: Path, mine: dict[str, torch.Tensor]) -> dict:
            kinds = {"weights": {}, "optimizer": {}}
            for key, t in mine.items():
                kind, name = key.split("/", 1)
                kinds[kind][name] = t
            return write_state_part(tmp, self.dp.rank, self.dp.size, kinds["weights"], kinds["optimizer"])

        report = save_sharded(Path(directory), self.dp, self.unit(unit).save_sources(),  # type: ignore[attr-defined]
                              write, lambda tmp, parts: commit_sharded_state(tmp, Path(directory), header, parts), what)
        self.last_save_peak_bytes = report.peak_bytes
        return report.size

    def save_hf_sharded(self, directory: str, base_dir: str, age_recipients: tuple[str, ...], what: str) -> int:
        """Write the weights as a Hugging Face model directory from every rank, each its own
        shard file (rank 0 the index, config and tokenizer, and the commit, age-encrypted to the
        recipients when any); rank 0's bytes committed."""
        from tinsmith.checkpoints.age_encryption import parse_recipients
        from tinsmith.checkpoints.export import commit_hf_parts, write_hf_part

        tr = self.unit(FULL_UNIT)
        sources = [SaveSource(n, p.detach()) for n, p in tr.named_params]
        write = lambda tmp, mine: write_hf_part(tmp, self.dp.rank, self.dp.size, mine, Path(base_dir))  # noqa: E731
        commit = lambda tmp, parts: commit_hf_parts(tmp, Path(directory), parts, Path(base_dir),  # noqa: E731
                                                    parse_recipients(age_recipients))
        report = save_sharded(Path(directory), self.dp, sources, write, commit, what)
        self.last_save_peak_bytes = report.peak_bytes
        return report.size
