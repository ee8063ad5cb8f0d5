"""Data builders and raw-HTTP helpers shared by the end-to-end tests."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

RESULT_TIMEOUT_S = 60.0  # no single tiny-model request may take longer: a hang fails the test
PROTOBUF = "application/x-protobuf"


# ---------------------------------------------------------------------------------------- data
INTERNAL_ERROR_MARKERS = ("Traceback", "internal error", "unhandled error")


def assert_no_internal_errors(log_text: str) -> None:
    """The server log (or the part of it a test produced) shows no unhandled error."""
    for marker in INTERNAL_ERROR_MARKERS:
        assert marker not in log_text, f"server logged {marker!r}:\n{log_text[-4000:]}"


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token prediction over ``tokens``: input ``tokens[:-1]``, targets ``tokens[1:]``."""
    n = len(tokens) - 1
    inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
    inputs["weights"] = [1.0] * n if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def sft_batch(seed: int, n_seqs: int, seq_len: int, vocab: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [sft_datum(random_tokens(rng, seq_len + 1, vocab)) for _ in range(n_seqs)]


def repeated_pattern_tokens(seed: int, n_seqs: int, seq_len: int, vocab: int) -> list[list[int]]:
    """``n_seqs`` sequences of ``seq_len + 1`` tokens repeating one short random pattern."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab, 8).tolist()
    cycle = pattern * (seq_len // len(pattern) + 2)
    return [cycle[i % len(pattern):][: seq_len + 1] for i in range(n_seqs)]


def repeated_pattern_batch(seed: int, n_seqs: int, seq_len: int, vocab: int) -> list[types.Datum]:
    """Sequences repeating one short random pattern: easy to learn, so SFT loss falls fast."""
    return [sft_datum(t) for t in repeated_pattern_tokens(seed, n_seqs, seq_len, vocab)]


def logprobs_of(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in output.loss_fn_outputs]


def loss_sum(output: types.ForwardBackwardOutput) -> float:
    return float(output.metrics["loss:sum"])


# ---------------------------------------------------------------------------------------- SDK
def lora_client(sc: tinker.ServiceClient, base_model: str, *, rank: int = 4, seed: int = 0) -> tinker.TrainingClient:
    return sc.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result(timeout=RESULT_TIMEOUT_S)


def train_steps(tc: tinker.TrainingClient, data: list[types.Datum], steps: int, lr: float = 1e-2) -> list[float]:
    """``steps`` rounds of forward_backward + optim_step; the loss of each forward_backward."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(loss_sum(fb.result(timeout=RESULT_TIMEOUT_S)))
        op.result(timeout=RESULT_TIMEOUT_S)
    return losses


def lora_round_trip(sc: tinker.ServiceClient, base_model: str, data: list[types.Datum], name: str, *,
                    save_state: bool = False) -> dict:
    """Six rank-8 LoRA training steps on ``data``, then the adapter saved for sampling (and the
    training state when ``save_state``): ``{"sc", "tc", "losses", "sampler_path"[, "state_path"]}``,
    what the model-family tests read."""
    tc = lora_client(sc, base_model, rank=8, seed=3)
    out: dict[str, Any] = {"sc": sc, "tc": tc, "losses": train_steps(tc, data, 6, 1e-2)}
    if save_state:
        out["state_path"] = tc.save_state(f"{name}-state").result(timeout=RESULT_TIMEOUT_S).path
    out["sampler_path"] = tc.save_weights_for_sampler(name).result(timeout=RESULT_TIMEOUT_S).path
    return out


def assert_sample_matches_forward(sampler: tinker.SamplingClient, tc: tinker.TrainingClient,
                                  prompt: types.ModelInput, params: types.SamplingParams) -> types.Datum:
    """One sample of ``params.max_tokens`` tokens carries, token by token, the logprobs that ``tc``'s
    full forward pass over prompt + sample gives them; returns that whole sequence as a datum."""
    seq = sampler.sample(prompt, 1, params).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    assert len(seq.tokens) == params.max_tokens and seq.logprobs is not None
    full = prompt.to_ints() + list(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    forward = logprobs_of(tc.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S))[0]
    np.testing.assert_allclose(seq.logprobs, forward[prompt.length - 1:], rtol=1e-4, atol=1e-4)
    return datum


def assert_peft_export_matches(tc: tinker.TrainingClient, adapter_dir, data: list[types.Datum], load_base) -> None:
    """peft, loading the exported adapter at ``adapter_dir`` onto ``load_base()`` (a fresh fp32
    transformers model), gives the logprobs ``tc`` gives ``data``; the bare base model does not."""
    from peft import PeftModel

    ours = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    ref = gathered_logprobs(PeftModel.from_pretrained(load_base(), str(adapter_dir)).eval(), data)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    plain = gathered_logprobs(load_base().eval(), data)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, plain)) > 1e-2  # the adapter matters


def session_id_of(tc: tinker.TrainingClient) -> str:
    return str(tc.model_id).split(":train:")[0]


# ---------------------------------------------------------------------------------------- raw HTTP
def raw_client(base_url: str, api_key: str = "tml-e2e") -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}, timeout=RESULT_TIMEOUT_S)


def fb_proto_body(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy",
                  forward_only: bool = False) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id, seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def post_fb(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTOBUF})


def retrieve(http: httpx.Client, request_id: str, *, protobuf: bool = True,
             timeout: float = RESULT_TIMEOUT_S) -> httpx.Response:
    """Poll ``retrieve_future`` until the answer is not ``try_again``; returns the final response."""
    deadline = time.monotonic() + timeout
    headers = {"Accept": PROTOBUF} if protobuf else {}
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False},
                      headers=headers)
        if r.status_code != 200 or "json" not in r.headers.get("content-type", ""):
            return r
        if r.json().get("type") != "try_again":
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"request {request_id} still pending after {timeout} s")


def fb_result(http: httpx.Client, request_id: str) -> types.ForwardBackwardOutput:
    r = retrieve(http, request_id)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(PROTOBUF), r.text
    return deserialize_forward_backward_output(r.content)


def json_result(http: httpx.Client, request_id: str) -> dict:
    r = retrieve(http, request_id, protobuf=False)
    assert r.status_code == 200, r.text
    return r.json()


def detail(r: httpx.Response) -> str:
    """The error message of a JSON error response (asserting there is one)."""
    assert "json" in r.headers.get("content-type", ""), (r.status_code, r.headers, r.content[:200])
    body = r.json()
    assert isinstance(body.get("detail"), str) and body["detail"], body
    return body["detail"]


def gathered_logprobs(model, data) -> list:
    """log_softmax of a ``transformers`` model's logits at each datum's target tokens (fp32)."""
    import torch

    out = []
    with torch.no_grad():
        for d in data:
            ids = torch.tensor([d.model_input.to_ints()])
            targets = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            out.append(logp[torch.arange(len(targets)), targets].double().numpy())
    return out


def lora_adapter_bytes(model_dir, rank: int) -> int:
    """float32 bytes of a LoRA adapter of ``rank`` on every attention, MLP and unembedding
    projection of the model at ``model_dir`` (the SDK's defaults): what a sampler-weights save
    writes, and a quarter of a training-state save (weights, two Adam moments, PEFT copy)."""
    from tinsmith.models.loading import load_model

    model = load_model(str(model_dir)).model
    return sum(4 * rank * (layer.in_features + layer.out_features)
               for _, layer in model.lora_targets(True, True, True))
