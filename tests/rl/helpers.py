"""Data builders for the RL and checkpoint tests (the toy task, RL datums, provenance)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import tinker
from tinker import types

from tests.e2e.helpers import RESULT_TIMEOUT_S
from tests.e2e.server import ServerProcess
from tinsmith.checkpoints.paths import checkpoint_directory, parse_tinker_path

# ------------------------------------------------------------------------------ the toy task
# Prompt PROMPT, then COMPLETION_LEN tokens each drawn from CHOICES. SFT on every combination
# teaches the model "a choice token, uniformly" at every completion position, so a sampler
# starts with P(TARGET) ~ 1/4 per token; RL then rewards the fraction of TARGET tokens.
PROMPT = [11, 57, 203]
CHOICES = [101, 202, 303, 404]
TARGET = CHOICES[0]
COMPLETION_LEN = 2


def choice_sft_data() -> list[types.Datum]:
    """Every completion in CHOICES^COMPLETION_LEN after PROMPT; loss on the completion only."""
    out = []
    p = len(PROMPT)
    for combo in itertools.product(CHOICES, repeat=COMPLETION_LEN):
        full = PROMPT + list(combo)
        weights = [0.0] * (p - 1) + [1.0 / COMPLETION_LEN] * COMPLETION_LEN
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
    return out


def reward(tokens: list[int]) -> float:
    return float(np.mean([t == TARGET for t in tokens])) if tokens else 0.0


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float,
             extra: dict | None = None) -> types.Datum:
    """The cookbook's layout: input prompt + sampled[:-1]; targets prompt[1:] + sampled;
    sampler logprobs and advantages are 0 on the prompt positions."""
    toks, lps = list(seq.tokens), list(seq.logprobs)
    full = prompt + toks
    p = len(prompt)
    inputs = {"target_tokens": full[1:],
              "logprobs": [0.0] * (p - 1) + lps,
              "advantages": [0.0] * (p - 1) + [float(advantage)] * len(toks)}
    inputs.update(extra or {})
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def with_sampled_provenance(datum: types.Datum, prompt_len: int, seq: types.SampledSequence) -> types.Datum:
    """Provenance spans as tinker_cookbook's ``rl_loop.with_sampled_provenance`` builds them:
    the input is the prompt then the first S-1 sampled tokens; the targets are the prompt from
    position 1 then all S sampled tokens."""
    s = len(seq.tokens)
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=prompt_len),
                     types.SampledProvenanceSpan(sequence_id=sid, length=s - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=prompt_len - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=s)],
    )


def group_advantages(rewards: list[float]) -> list[float]:
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).tolist()


# ------------------------------------------------------------------------------ SDK helpers
def train_steps_on(tc: tinker.TrainingClient, data: list[types.Datum], steps: int, lr: float,
                   loss_fn: str = "cross_entropy") -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, loss_fn)
        op = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(float(fb.result(timeout=RESULT_TIMEOUT_S).metrics["loss:sum"]))
        op.result(timeout=RESULT_TIMEOUT_S)
    return losses


def checkpoint_dir(srv: ServerProcess, tinker_path: str) -> Path:
    """Where the server keeps the checkpoint ``tinker_path`` (its default checkpoint dir)."""
    return checkpoint_directory((srv.data_dir / "checkpoints").resolve(), parse_tinker_path(tinker_path))


def all_finite(metrics: dict[str, float]) -> bool:
    return all(np.isfinite(float(v)) for v in metrics.values())


def full_finetune_client(sc: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    """A full fine-tuning ``TrainingClient``: the SDK has no public call for one, so this sends
    its own ``CreateModelRequest`` without a ``lora_config`` through the SDK's transport,
    exactly as ``create_lora_training_client`` does with one."""
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = sc.holder
    session_id, model_seq_id = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> TrainingClient:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            future = await client.models.create(request=types.CreateModelRequest(
                session_id=session_id, model_seq_id=model_seq_id, base_model=base_model, lora_config=None,
                optimizer_config=types.AdamOptimizerConfig()))
        created = await _APIFuture(types.CreateModelResponse, holder, future, request_start_time=0.0,
                                   request_type="CreateModel").result_async()
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=created.model_id,
                              info=await fetch_training_info(holder, created.model_id))

    return holder.run_coroutine_threadsafe(create()).result(timeout=RESULT_TIMEOUT_S)
