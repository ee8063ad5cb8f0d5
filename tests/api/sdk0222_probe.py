"""Run with the interpreter of ``.venv-sdk-0.22.2`` (tinker==0.22.2), never imported by tests.

``python sdk0222_probe.py requests``: print the JSON bodies the 0.22.2 SDK itself posts for a
few forward_backward / forward / asample calls (built through its own resource classes with a
capturing fake HTTP client).

``python sdk0222_probe.py parse < payload.json``: parse our encoded results with the 0.22.2
SDK's own result handling (JSON and protobuf) and print what it sees.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import sys
from types import SimpleNamespace

from tinker import types
from tinker.lib._pydantic_conv import deserialize_json_response
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response
from tinker.resources.sampling import AsyncSamplingResource
from tinker.resources.training import AsyncTrainingResource


class _CapturingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.get = self.patch = self.put = self.delete = self.get_api_list = None

    async def post(self, path, *, body=None, options=None, cast_to=None, **_):
        self.calls.append((path, body))
        return SimpleNamespace(request_id="r")


def _requests() -> dict:
    client = _CapturingClient()
    training = AsyncTrainingResource(client)  # type: ignore[arg-type]
    sampling = AsyncSamplingResource(client)  # type: ignore[arg-type]

    datum_1d = types.Datum(
        model_input=types.ModelInput.from_ints([11, 12, 13, 14]),
        loss_fn_inputs={"target_tokens": [12, 13, 14, 15], "weights": [0.0, 1.0, 1.0, 0.5]},
    )
    datum_2d_sparse = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                             types.EncodedTextChunk(tokens=[3])]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[5, 6, 7, 8, 9, 10], dtype="int64",
                                              shape=[3, 2]),
            "weights": types.TensorData(data=[0.75, 0.25], dtype="float32", shape=[3, 2],
                                        sparse_crow_indices=[0, 1, 1, 2],
                                        sparse_col_indices=[0, 1]),
        },
    )
    datum_no_shape = types.Datum(
        model_input=types.ModelInput.from_ints([7, 8]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[8, 9], dtype="int64")},
    )
    fbi = types.ForwardBackwardInput(
        data=[datum_1d, datum_2d_sparse, datum_no_shape], loss_fn="cross_entropy",
        loss_fn_config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
    )

    async def go() -> None:
        await training.forward_backward(
            request=types.ForwardBackwardRequest(forward_backward_input=fbi, model_id="s:train:0",
                                                 seq_id=3))
        await training.forward(
            request=types.ForwardRequest(
                forward_input=types.ForwardBackwardInput(data=[datum_1d], loss_fn="cross_entropy"),
                model_id="s:train:0", seq_id=4))
        await sampling.asample(request=types.SampleRequest(
            sampling_session_id="s:sample:0", seq_id=0, num_samples=2,
            prompt=types.ModelInput.from_ints([5, 6, 7]),
            sampling_params=types.SamplingParams(max_tokens=4, stop="\n", seed=-5),
            prompt_logprobs=True, topk_prompt_logprobs=2))
        await sampling.asample(request=types.SampleRequest(
            sampling_session_id="s:sample:0", seq_id=1,
            prompt=types.ModelInput.from_ints([5]),
            sampling_params=types.SamplingParams(stop=[3, 4], temperature=0.5, top_k=20,
                                                 top_p=0.9),
            prompt_logprobs=False, topk_prompt_logprobs=0))

    asyncio.run(go())
    names = ["forward_backward", "forward", "asample_logprobs", "asample_plain"]
    out = {name: {"path": path, "body": body} for name, (path, body) in zip(names, client.calls)}
    # What 0.22.2 posts instead when the server's client config sets proto_write_fwdbwd.
    proto = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(forward_backward_input=fbi, model_id="s:train:0", seq_id=3))
    out["forward_backward_proto"] = {"path": "/api/v1/forward_backward",
                                     "body": base64.b64encode(proto.SerializeToString()).decode()}
    return out


def _float(x):
    return None if x is None else (repr(x) if not math.isfinite(x) else x)


def _parse(payload: dict) -> dict:
    out: dict = {}
    for name, fb in (("fb_json", deserialize_json_response(payload["fb_json"],
                                                           types.ForwardBackwardOutput)),
                     ("fb_proto", deserialize_proto_response(base64.b64decode(payload["fb_proto"]),
                                                             types.ForwardBackwardOutput))):
        out[name] = {
            "loss_fn_output_type": fb.loss_fn_output_type,
            "metrics": {k: _float(v) for k, v in fb.metrics.items()},
            "outputs": [{k: {"dtype": td.dtype, "shape": td.shape,
                             "data": [_float(x) for x in td.to_numpy().ravel().tolist()]}
                         for k, td in o.items()} for o in fb.loss_fn_outputs],
        }
    for name, sr in (("sample_json", deserialize_json_response(payload["sample_json"],
                                                               types.SampleResponse)),
                     ("sample_proto", deserialize_proto_response(
                         base64.b64decode(payload["sample_proto"]), types.SampleResponse))):
        out[name] = {
            "sequences": [{"stop_reason": s.stop_reason, "tokens": s.tokens,
                           "logprobs": [_float(x) for x in (s.logprobs or [])]}
                          for s in sr.sequences],
            "prompt_logprobs": (None if sr.prompt_logprobs is None
                                else [_float(x) for x in sr.prompt_logprobs]),
            "topk_prompt_logprobs": (None if sr.topk_prompt_logprobs is None else
                                     [None if row is None else [[t, lp] for t, lp in row]
                                      for row in sr.topk_prompt_logprobs]),
        }
    return out


if __name__ == "__main__":
    if sys.argv[1] == "requests":
        print(json.dumps(_requests()))
    else:
        print(json.dumps(_parse(json.load(sys.stdin))))
