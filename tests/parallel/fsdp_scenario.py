"""Sharded full fine-tuning scenarios, run alike in one process and on each data-parallel rank.

They live in an importable module (not a test file) because the rank processes import them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.parallel.scenario import fault_or_forward, make_data
from tinsmith.checkpoints.state_format import TrainingState, load_training_state, save_training_state
from tinsmith.models.loading import load_model
from tinsmith.parallel.fsdp import FsdpTrainingRuntime, shard_full_model
from tinsmith.parallel.group import TPGroup
from tinsmith.types import AdamParams, DimuonParams, ForwardBackwardInput
from tinsmith.worker.runtime import FULL_UNIT, TrainingRuntime, TrainRequest

# Small micro-batches, so that a call runs several and the ranks' counts differ (padding runs).
MICRO_BATCH_TOKENS = 16
# Datum lengths of the two calls: two training requests and a forward-only one each. Under DP=2
# the second call pads a rank in each phase (see the test).
CALLS = [([9, 5, 13], [7, 4], [6, 11]), ([14, 9], [5], [9, 5, 13])]


def build_full_runtime(model_dir: str, dp: TPGroup | None, optimizer: str = "adamw") -> TrainingRuntime:
    """One process's full fine-tune (``dp`` None), or this rank's sharded one; fp32. The tied
    model recomputes every layer in backward (gradient checkpointing) and pads its micro-batches;
    the untied one recomputes only in micro-batches above 12 tokens, so the two ranks recompute in
    different micro-batches, and packs its micro-batches (documents end to end)."""
    model = load_model(model_dir, "cpu", torch.float32).model
    tied = model.config.tie_word_embeddings
    kw = dict(micro_batch_tokens=MICRO_BATCH_TOKENS, logit_chunk_bytes=4 * model.config.vocab_size * 5,
              gradient_checkpointing=tied, checkpoint_above_tokens=None if tied else 12, packing=not tied)
    if dp is None:
        return TrainingRuntime(model, full_finetune=True, full_optimizer=optimizer, **kw)
    return FsdpTrainingRuntime(shard_full_model(model, dp), full_optimizer=optimizer, **kw)


def _state(rt) -> tuple[dict, dict]:
    if hasattr(rt, "export_full_state"):
        return rt.export_full_state(FULL_UNIT)
    return rt.unit(FULL_UNIT).export_state()


def _load(rt, weights: dict, optimizer: dict | None) -> None:
    if hasattr(rt, "import_full_state"):
        rt.import_full_state(FULL_UNIT, weights, optimizer)
    else:
        rt.unit(FULL_UNIT).import_state(weights, optimizer)


class Driven:
    """The runtime's calls as rank 0 issues them through :class:`SpmdExecutor` (every rank runs them)."""

    def __init__(self, executor, config):
        self.executor, self.config, self.dp = executor, config, executor.tp

    def __getattr__(self, method: str):
        if method not in ("forward_backward", "optim_step", "export_full_state", "import_full_state"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.executor.call(method, *args, **kwargs)


def _check(results: list) -> list:
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def train_scenario(rt, save_to: str | None = None, load_from: str | None = None) -> dict:
    """Two clipped AdamW steps, each after a call of two training requests and one forward-only
    request (datums of uneven lengths); what they return, the state after them, logprobs after.
    Before the first step a second call adds its gradients to the first's, and a request with a
    token outside the vocabulary is refused alone.

    ``save_to``: write the state after the steps there (rank 0 writes under data parallelism).
    ``load_from``: then load that checkpoint and report the state and logprobs it gives.
    """
    vocab = rt.config.vocab_size
    rank = getattr(getattr(rt, "dp", None), "rank", 0)
    out: dict = {"logprobs": [], "loss": [], "step": []}
    for step, lengths in enumerate(CALLS):
        a, b, c = (make_data(10 * step + i, n, vocab) for i, n in enumerate(lengths))
        res = _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(a, "cross_entropy")),
                                          TrainRequest(FULL_UNIT, ForwardBackwardInput(b, "cross_entropy")),
                                          TrainRequest(FULL_UNIT, ForwardBackwardInput(c, "cross_entropy",
                                                                                       forward_only=True))]))
        out["logprobs"].append([torch.from_numpy(o["logprobs"]) for r in res for o in r.outputs])
        out["loss"].append([r.metrics["loss:sum"] for r in res])
        if step == 0:
            bad = make_data(7, [4], vocab)
            bad[0].tokens[1] = vocab
            more, refused = rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(make_data(8, [6], vocab),
                                                                                              "cross_entropy")),
                                                 TrainRequest(FULL_UNIT, ForwardBackwardInput(bad, "cross_entropy"))])
            out["loss"][-1].append(_check([more])[0].metrics["loss:sum"])
            out["refused"] = f"{type(refused).__name__}: {refused}"
        out["step"].append(rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)))
    out["after"] = _state(rt)
    again = make_data(1, [9, 5, 13], vocab)
    (res,) = _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(again, "cross_entropy",
                                                                                      forward_only=True))]))
    out["logprobs_after"] = [torch.from_numpy(o["logprobs"]) for o in res.outputs]
    if save_to is not None and rank == 0:
        w, o = out["after"]
        save_training_state(Path(save_to), TrainingState("tiny", None, w, o, steps=2))
    if load_from is not None:
        out["loaded"] = load_and_score(rt, load_from)
    return out


def load_and_score(rt, load_from: str) -> dict:
    """Load a full fine-tune's checkpoint into ``rt``: the state it then holds, logprobs, and the
    state after one more step (which reads the loaded optimizer state)."""
    state = load_training_state(Path(load_from), with_optimizer=True)
    _load(rt, state.weights, state.optimizer)
    out: dict = {"state": _state(rt)}
    data = make_data(5, [8, 6, 3], rt.config.vocab_size)
    (res,) = _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(data, "cross_entropy"))]))
    out["logprobs"] = [torch.from_numpy(o["logprobs"]) for o in res.outputs]
    # Adam divides by the root of the second moment, so this step magnifies the loaded states'
    # float noise (DP=2 sums in another order) tenfold or more where gradients are small: at a
    # rate of 1e-3 that stays ~1e-6, well inside the comparison's 1e-5, while an optimizer state
    # loaded wrong (lost moments, another step count) still moves weights by ~1e-4 or more.
    rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-3))
    out["stepped"] = _state(rt)
    return out


def train_rank_main(dp: TPGroup, model_dir: str, save_to: str, load_from: str, driven: bool = False) -> dict | int:
    """Each rank: the scenario on its sharded runtime, every rank calling it (``driven`` False),
    or rank 0 issuing the calls through the executor while the others follow (they return the
    number of calls they ran)."""
    from tinsmith.parallel.spmd import SpmdExecutor

    rt = build_full_runtime(model_dir, dp)
    if not driven:
        out = train_scenario(rt, save_to=save_to, load_from=load_from)
        rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(make_data(9, [4], rt.config.vocab_size),
                                                                          "cross_entropy"))])
        out["held"] = rt.held_elements()  # with gradients and optimizer state present
        # A server reads rank 0's exports only: the other ranks join each gather and keep nothing.
        rt.unit(FULL_UNIT).export_everywhere = False
        weights, opt = rt.export_full_state(FULL_UNIT)
        out["kept"] = (len(weights), len(opt), len(rt.export_weights()))
        return out
    ex = SpmdExecutor(rt, dp)
    if not ex.is_driver:
        return ex.follow()
    out = train_scenario(Driven(ex, rt.config), save_to=save_to, load_from=load_from)
    ex.stop()
    return out


def faulty_rank_main(dp: TPGroup, model_dir: str, fault: str, stall_s: float) -> dict | None:
    """Both ranks shard the model; rank 1 then raises, exits or stalls instead of joining the
    forward pass, and rank 0 reports what its call came to."""
    rt = build_full_runtime(model_dir, dp)
    return fault_or_forward(dp.rank, fault, stall_s, lambda: rt.forward_backward(
        [TrainRequest(FULL_UNIT, ForwardBackwardInput(make_data(1, [8, 5], rt.config.vocab_size), "cross_entropy"))]))


def bf16_call(rt) -> dict:
    """One training call and one AdamW step computing in bf16; the fp32 state after it."""
    data = make_data(1, [9, 5, 13], rt.config.vocab_size)
    (res,) = _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(data, "cross_entropy"))]))
    step = rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-3))
    return {"logprobs": [torch.from_numpy(o["logprobs"]) for o in res.outputs], "loss": res.metrics["loss:sum"],
            "grad_norm": step["grad_norm"], "weights": _state(rt)[0]}


def bf16_rank_main(dp: TPGroup, model_dir: str) -> dict:
    """This rank's share of a bf16 model's full fine-tune, computing in bf16 as on a GPU."""
    model = load_model(model_dir, "cpu", torch.bfloat16).model
    rt = FsdpTrainingRuntime(shard_full_model(model, dp, compute_dtype=torch.bfloat16),
                             micro_batch_tokens=MICRO_BATCH_TOKENS)
    return bf16_call(rt)


def _custom(fn, ranks: dict):
    """A server-side custom loss as the server binds it: traced by the SDK, decoded, bounded."""
    import json

    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from tinsmith.custom_losses import BoundCustomLoss, RunLimits, decode_custom_loss

    handle = trace_loss(fn, ranks, "s")
    graph = json.loads(encode_graph(handle).model_dump_json())
    loss = decode_custom_loss(handle.name, [x.model_dump() for x in handle.inputs], graph, max_nodes=100)
    return BoundCustomLoss(f"s:{fn.__name__}", loss, RunLimits(max_elements=1 << 20, timeout_s=30.0))


def _custom_input(data, custom) -> ForwardBackwardInput:
    return ForwardBackwardInput(data, "custom", {"loss_id": custom.loss_id}, custom_loss=custom)


def custom_scenario(rt) -> dict:
    """Server-side custom losses on a full fine-tune: a call of a weighted NLL request (its
    ``:sum`` and ``:mean`` metrics) and a PPO-clipped one, a clipped AdamW step, the state and
    logprobs after it; then a loss that passes its dry run but is refused on the real logprobs,
    by a whole call and by the engine's begin/advance, and a call after it that still trains."""
    import numpy as np

    from tests.custom_losses.losses import LOSSES
    from tests.custom_losses.test_runtime import confident_only

    vocab = rt.config.vocab_size
    g = np.random.default_rng(3)
    nll, ppo = _custom(*LOSSES["weighted_nll"]), _custom(*LOSSES["ppo_clipped"])
    a = make_data(30, [9, 5, 13], vocab)
    b = make_data(31, [7, 11], vocab)
    for d in b:
        n = len(d.tokens)
        d.loss_inputs = {"target_tokens": d.loss_inputs["target_tokens"],
                         "sampler_logprobs": g.uniform(-7.0, -5.0, n).astype(np.float32),
                         "advantages": g.normal(size=n).astype(np.float32)}
    res = _check(rt.forward_backward([TrainRequest(FULL_UNIT, _custom_input(a, nll)),
                                      TrainRequest(FULL_UNIT, _custom_input(b, ppo))]))
    out: dict = {"logprobs": [torch.from_numpy(o["logprobs"]) for r in res for o in r.outputs],
                 "metrics": [dict(sorted(r.metrics.items())) for r in res]}
    out["step"] = rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    out["after"] = _state(rt)
    bad = _custom(confident_only, {"logprobs": 1, "weights": 1})
    refused = rt.forward_backward([TrainRequest(FULL_UNIT, _custom_input(make_data(32, [12, 6], vocab), bad)),
                                   TrainRequest(FULL_UNIT, ForwardBackwardInput(make_data(33, [5], vocab),
                                                                                "cross_entropy"))])
    out["refused"] = [f"{type(r).__name__}: {r}" for r in refused]
    if hasattr(rt, "begin"):
        p = rt.begin([TrainRequest(FULL_UNIT, _custom_input(make_data(34, [10, 8, 4], vocab), bad))])
        while not p.done:
            rt.advance([(p, 1 << 20)])
        out["refused_pass"] = [f"{type(r).__name__}: {r}" for r in p.results]
    rt.unit(FULL_UNIT).optimizer.zero_grad(set_to_none=True)  # a refused pass keeps what it ran (one process too)
    (again,) = _check(rt.forward_backward([TrainRequest(FULL_UNIT, _custom_input(make_data(35, [8, 6], vocab), nll))]))
    out["again"] = again.metrics["loss:sum"]
    return out


def custom_rank_main(dp: TPGroup, model_dir: str) -> dict:
    return custom_scenario(build_full_runtime(model_dir, dp))


def dimuon_scenario(rt) -> dict:
    """Two clipped Dimuon steps of a full fine-tune, each after a call of two training requests
    (the second step builds on the first's momentum); what each returns, the weights and momenta
    after each, logprobs after them."""
    vocab = rt.config.vocab_size
    out: dict = {"step": [], "after": []}
    for step, lengths in enumerate(CALLS):
        a, b = (make_data(40 + 10 * step + i, n, vocab) for i, n in enumerate(lengths[:2]))
        _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(a, "cross_entropy")),
                                    TrainRequest(FULL_UNIT, ForwardBackwardInput(b, "cross_entropy"))]))
        out["step"].append(rt.optim_step(FULL_UNIT, DimuonParams(learning_rate=1e-2, grad_clip_norm=1.0)))
        out["after"].append(_state(rt))
    again = make_data(1, [9, 5, 13], vocab)
    (res,) = _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(again, "cross_entropy",
                                                                                      forward_only=True))]))
    out["logprobs_after"] = [torch.from_numpy(o["logprobs"]) for o in res.outputs]
    return out


def dimuon_rank_main(dp: TPGroup, model_dir: str) -> dict:
    return dimuon_scenario(build_full_runtime(model_dir, dp, "dimuon"))


def stepped_checkpoint(model_dir: str, directory: str) -> tuple[dict, dict]:
    """One process's full fine-tune after a clipped AdamW step, saved at ``directory``; its state."""
    rt = build_full_runtime(model_dir, None)
    _check(rt.forward_backward([TrainRequest(FULL_UNIT, ForwardBackwardInput(make_data(60, [9, 5], rt.config.vocab_size),
                                                                              "cross_entropy"))]))
    rt.optim_step(FULL_UNIT, AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    w, o = _state(rt)
    save_training_state(Path(directory), TrainingState("tiny", None, w, o, steps=1))
    return w, o


def stored_load_rank_main(dp: TPGroup, model_dir: str, directory: str) -> dict:
    """Each rank loads the checkpoint from its files, reading only its rows (any read of a whole
    tensor but a step count fails here); then a checkpoint rank 1 alone cannot read is refused on
    both ranks alike and changes nothing."""
    from tinsmith.checkpoints.state_format import load_training_state
    from tinsmith.checkpoints.stored_tensors import StoredTensors
    from tinsmith.errors import InvalidInputError

    whole = StoredTensors.__getitem__

    def step_counts_only(self, name):
        assert name.endswith(".step"), f"{name} read whole"
        return whole(self, name)

    rt = build_full_runtime(model_dir, dp)
    # (the server checks the weights' values as it opens the checkpoint, on rank 0, a tensor at a time)
    state = load_training_state(Path(directory), with_optimizer=True, stored=True)
    unreadable = load_training_state(Path(directory), with_optimizer=True, stored=True)
    StoredTensors.__getitem__ = step_counts_only
    _load(rt, state.weights, state.optimizer)
    out: dict = {"loaded": _state(rt)}
    if dp.rank == 1:
        unreadable.optimizer.files = [f + ".gone" for f in unreadable.optimizer.files]
    try:
        _load(rt, unreadable.weights, unreadable.optimizer)
        out["refused"] = None
    except InvalidInputError as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = _state(rt)
    return out
