"""Drive a tinsmith server with ``tinker==0.22.2`` (the last JSON-wire SDK); print results as JSON.

Run with the interpreter of ``.venv-sdk-0.22.2``; never imported by the tests (it needs that
SDK version). Usage::

    python sdk0222_client.py '{"base_url": ..., "base_model": ..., "probe": [[tokens], ...],
                               "probe_2d": {"tokens": [...], "targets": [[...], ...]},
                               "train": [[tokens], ...], "steps": 5, "lr": 0.005}'

Prints one JSON object: the SDK version, the model id and info, the probe's logprobs on the
fresh adapter (1-D and 2-D targets), every training step's loss and optimizer metrics, and the
probe's logprobs after training.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def logprobs(out) -> list[list[float]]:
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64).tolist() for o in out.loss_fn_outputs]


def main() -> None:
    args = json.loads(sys.argv[1])
    sc = tinker.ServiceClient(base_url=args["base_url"], api_key="tml-e2e-sdk0222")
    tc = sc.create_lora_training_client(base_model=args["base_model"], rank=4, seed=0)
    info = tc.get_info()
    probe = [datum(t) for t in args["probe"]]
    fresh = logprobs(tc.forward(probe, "cross_entropy").result(timeout=60))

    p2 = args["probe_2d"]
    targets = np.asarray(p2["targets"], dtype=np.int64)
    d2 = types.Datum(model_input=types.ModelInput.from_ints(p2["tokens"]),
                     loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets),
                                     "weights": types.TensorData.from_numpy(np.ones(targets.shape, np.float32))})
    out2 = tc.forward([d2], "cross_entropy").result(timeout=60)
    td2 = out2.loss_fn_outputs[0]["logprobs"]

    train = [datum(t) for t in args["train"]]
    losses, optim_metrics = [], []
    for _ in range(args["steps"]):
        fb = tc.forward_backward(train, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=args["lr"]))
        losses.append(fb.result(timeout=60).metrics["loss:sum"])
        optim_metrics.append(op.result(timeout=60).metrics)
    trained = logprobs(tc.forward(probe, "cross_entropy").result(timeout=60))

    print(json.dumps({
        "sdk_version": tinker.__version__,
        "model_id": tc.model_id,
        "info": {"model_id": info.model_id, "model_name": info.model_data.model_name,
                 "is_lora": info.is_lora, "lora_rank": info.lora_rank},
        "fresh_logprobs": fresh,
        "logprobs_2d": {"shape": list(td2.shape or []), "data": np.asarray(td2.to_numpy(), np.float64).tolist()},
        "losses": losses,
        "optim_metrics": optim_metrics,
        "trained_logprobs": trained,
    }))


if __name__ == "__main__":
    main()
