"""Wire codecs against the SDK's own client code.

Requests are produced by the ``tinker`` 0.38.0 SDK's resource classes (a fake HTTP client
captures exactly the body and headers the SDK would post); results are decoded with the SDK's
own ``tinker.proto.response_conv``. The JSON generation is checked against ``tinker`` 0.22.2
running in ``.venv-sdk-0.22.2`` (created by ``scripts/setup``).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zstandard

from tinker import types as T
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)
from tinker.resources.sampling import AsyncSamplingResource
from tinker.resources.training import AsyncTrainingResource
from tinsmith.api.codecs import (
    decode_forward_backward_json,
    decode_forward_backward_protobuf,
    decode_sample_request_json,
    encode_forward_backward_output_json,
    encode_forward_backward_output_protobuf,
    encode_sample_response_json,
    encode_sample_response_protobuf,
)
from tinsmith.api.request import BodyTooLarge, decode_content
from tinsmith.errors import InvalidInputError
from tinsmith.types import (
    ForwardBackwardResult,
    ProvenanceSpan,
    SampledSequence,
    SampleResult,
)

REPO = Path(__file__).resolve().parents[2]
SDK0222_PYTHON = REPO / ".venv-sdk-0.22.2" / "bin" / "python"
PROBE = Path(__file__).with_name("sdk0222_probe.py")


# ---------------------------------------------------------------------------------------------
# The SDK's own request construction


class _CapturingClient:
    """Stands in for AsyncTinker: records what the SDK's resource classes post."""

    def __init__(self, compress: bool = False) -> None:
        self._client_config = SimpleNamespace(proto_compress_fwdbwd=compress)
        self.calls: list[dict] = []
        self.get = self.patch = self.put = self.delete = self.get_api_list = None

    async def post(self, path, *, body=None, options=None, cast_to=None, **_):
        self.calls.append({"path": path, "body": body,
                           "headers": dict((options or {}).get("headers") or {})})
        return SimpleNamespace(request_id="r")


def sdk_forward_backward(data, loss_fn="cross_entropy", loss_fn_config=None, *,
                         forward_only=False, compress=False, model_id="sess:train:0", seq_id=1):
    """(body, content_encoding) exactly as TrainingClient posts /api/v1/forward_backward."""
    client = _CapturingClient(compress)
    request = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn=loss_fn,
                                                      loss_fn_config=loss_fn_config),
        model_id=model_id, seq_id=seq_id)
    asyncio.run(AsyncTrainingResource(client).forward_backward(  # type: ignore[arg-type]
        request=request, forward_only=forward_only))
    (call,) = client.calls
    assert call["path"] == "/api/v1/forward_backward"
    assert call["headers"]["Content-Type"] == "application/x-protobuf"
    return call["body"], call["headers"].get("Content-Encoding")


def decode_posted(body: bytes, content_encoding: str | None):
    """Decode a forward_backward body as the route does: Content-Encoding first, then protobuf."""
    return decode_forward_backward_protobuf(decode_content(body, content_encoding, 1 << 30))


def sdk_asample(**kwargs) -> dict:
    """The JSON body SamplingClient posts to /api/v1/asample (after a JSON round trip)."""
    client = _CapturingClient()
    kwargs.setdefault("sampling_session_id", "sess:sample:0")
    kwargs.setdefault("seq_id", 0)
    kwargs.setdefault("prompt", T.ModelInput.from_ints([1, 2, 3, 4]))
    kwargs.setdefault("sampling_params", T.SamplingParams(max_tokens=8))
    asyncio.run(AsyncSamplingResource(client).asample(  # type: ignore[arg-type]
        request=T.SampleRequest(**kwargs)))
    (call,) = client.calls
    assert call["path"] == "/api/v1/asample"
    return json.loads(json.dumps(call["body"]))


def datum(tokens, **inputs):
    return T.Datum(model_input=T.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


# ---------------------------------------------------------------------------------------------
# forward_backward protobuf requests


def test_protobuf_1d_targets_numeric_config_and_unread_inputs_dropped():
    """ppo does not read weights: they are dropped unread (as the hosted service ignores them)."""
    d0 = datum([10, 11, 12, 13], target_tokens=np.array([11, 12, 13, 14]),
               weights=np.array([0.0, 1.0, 1.0, 0.5], dtype=np.float32))
    d1 = datum([20, 21], target_tokens=[21, 22], weights=[1.0, 2.0],
               advantages=torch.tensor([0.5, -1.5]))
    body, enc = sdk_forward_backward([d0, d1], "ppo",
                                     {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                                     model_id="abc:train:3", seq_id=7)
    assert enc is None
    model_id, seq_id, fb = decode_posted(body, enc)
    assert (model_id, seq_id) == ("abc:train:3", 7)
    assert fb.loss_fn == "ppo" and fb.forward_only is False
    assert fb.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert len(fb.data) == 2
    a, b = fb.data
    assert a.tokens.dtype == np.int64 and a.tokens.tolist() == [10, 11, 12, 13]
    assert a.loss_inputs["target_tokens"].dtype == np.int64
    assert a.loss_inputs["target_tokens"].tolist() == [11, 12, 13, 14]
    assert "weights" not in a.loss_inputs and "weights" not in b.loss_inputs
    assert b.tokens.tolist() == [20, 21]
    np.testing.assert_array_equal(b.loss_inputs["advantages"], np.float32([0.5, -1.5]))
    assert a.model_input_spans == [] and a.loss_input_spans == []
    # Arrays are writable (the worker hands them to torch without copies or warnings).
    assert b.loss_inputs["advantages"].flags.writeable and a.tokens.flags.writeable


def test_protobuf_2d_targets_with_sparse_csr_weights():
    n, k = 6, 4
    targets = torch.arange(n * k, dtype=torch.int64).reshape(n, k) + 100
    weights = torch.zeros(n, k)
    weights[1, 2] = 0.25
    weights[4, 0] = 1.0
    d = T.Datum(model_input=T.ModelInput.from_ints(list(range(n))),
                loss_fn_inputs={"target_tokens": targets, "weights": weights})
    # The SDK chose CSR for the sparse weights; the targets are dense.
    assert d.loss_fn_inputs["weights"].sparse_crow_indices is not None
    assert d.loss_fn_inputs["target_tokens"].sparse_crow_indices is None
    body, enc = sdk_forward_backward([d])
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert msg.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"

    _, _, fb = decode_posted(body, enc)
    got = fb.data[0].loss_inputs
    assert got["target_tokens"].shape == (n, k)
    np.testing.assert_array_equal(got["target_tokens"], targets.numpy())
    assert got["weights"].shape == (n, k) and got["weights"].dtype == np.float32
    np.testing.assert_array_equal(got["weights"], weights.numpy())


def test_protobuf_sparse_integer_targets():
    targets = torch.zeros(5, 3, dtype=torch.int64)
    targets[0, 0] = 7
    targets[3, 2] = 9
    d = T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3, 4, 5]),
                loss_fn_inputs={"target_tokens": targets})
    assert d.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    _, _, fb = decode_posted(*sdk_forward_backward([d]))
    np.testing.assert_array_equal(fb.data[0].loss_inputs["target_tokens"], targets.numpy())
    assert "weights" not in fb.data[0].loss_inputs


def test_protobuf_missing_weights_and_empty_shape():
    td = T.TensorData(data=[4, 5, 6], dtype="int64")  # no shape: sent with an empty shape
    d = T.Datum(model_input=T.ModelInput.from_ints([3, 4, 5]), loss_fn_inputs={"target_tokens": td})
    body, enc = sdk_forward_backward([d])
    assert list(pb.ForwardBackwardRequest.FromString(body).data[0]
                .loss_fn_inputs["target_tokens"].shape) == []
    _, _, fb = decode_posted(body, enc)
    assert fb.data[0].loss_inputs["target_tokens"].shape == (3,)
    assert fb.data[0].loss_inputs["target_tokens"].tolist() == [4, 5, 6]
    assert set(fb.data[0].loss_inputs) == {"target_tokens"}


def test_protobuf_string_loss_config_prefers_v2():
    d = datum([1, 2], target_tokens=[2, 3])
    body, enc = sdk_forward_backward([d], "custom", {"loss_id": "loss-7", "beta": 0.5})
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert dict(msg.loss_fn_config) == {"beta": 0.5}  # the legacy map only has numbers
    _, _, fb = decode_posted(body, enc)
    assert fb.loss_fn == "custom"
    assert fb.loss_fn_config == {"loss_id": "loss-7", "beta": 0.5}
    assert isinstance(fb.loss_fn_config["beta"], float)

    # v2 wins over the legacy map; a legacy-only sender (older proto writers) still works.
    msg.loss_fn_config["beta"] = 9.0
    msg.loss_fn_config["legacy_only"] = 3.0
    _, _, fb = decode_forward_backward_protobuf(msg.SerializeToString())
    assert fb.loss_fn_config == {"loss_id": "loss-7", "beta": 0.5, "legacy_only": 3.0}


def test_protobuf_provenance_spans_and_forward_only():
    d = datum([1, 2, 3, 4, 5], target_tokens=[2, 3, 4, 5, 6]).with_provenance(
        model_input=[T.PromptProvenanceSpan(sequence_id="seq-a", offset=0, length=3),
                     T.SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=2)],
        loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id="seq-a", offset=1, length=2),
                        T.SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=3)])
    body, enc = sdk_forward_backward([d], "stable_reinforce", {"kl_coeff": 0.1},
                                     forward_only=True)
    _, _, fb = decode_posted(body, enc)
    assert fb.forward_only is True
    got = fb.data[0]
    assert got.model_input_spans == [ProvenanceSpan("prompt", "seq-a", 0, 3),
                                     ProvenanceSpan("sampled", "seq-a", 0, 2)]
    assert got.loss_input_spans == [ProvenanceSpan("prompt", "seq-a", 1, 2),
                                    ProvenanceSpan("sampled", "seq-a", 0, 3)]


def test_protobuf_zstd_body_and_multi_chunk_input():
    mi = T.ModelInput.from_ints([1, 2, 3]).append_int(4).append(T.EncodedTextChunk(tokens=[5, 6]))
    d = T.Datum(model_input=mi, loss_fn_inputs={"target_tokens": np.arange(2, 8)})
    body, enc = sdk_forward_backward([d] * 40, compress=True)
    assert enc == "zstd"
    assert body[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic: really compressed
    _, _, fb = decode_posted(body, enc)
    assert len(fb.data) == 40
    assert fb.data[39].tokens.tolist() == [1, 2, 3, 4, 5, 6]
    _, _, fb2 = decode_posted(body, "ZSTD")  # header value case-insensitive
    assert fb2.data[0].tokens.tolist() == [1, 2, 3, 4, 5, 6]


def test_protobuf_zstd_frame_without_content_size():
    d = datum([1, 2], target_tokens=[2, 3])
    raw, _ = sdk_forward_backward([d])
    streamed = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    body = streamed.compress(raw) + streamed.flush()
    _, _, fb = decode_posted(body, "zstd")
    assert fb.data[0].tokens.tolist() == [1, 2]
    assert decode_content(body, "zstd", len(raw)) == raw  # exactly the limit
    with pytest.raises(BodyTooLarge, match="exceeds the limit of 10 bytes"):
        decode_content(body, "zstd", 10)
    with pytest.raises(BodyTooLarge, match="exceeds the limit of 10 bytes"):
        decode_content(zstandard.ZstdCompressor().compress(raw), "zstd", 10)  # size declared in the frame


def test_protobuf_int32_and_bfloat16_tensors():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3], "<i4").tobytes()
    tt = d.loss_fn_inputs["target_tokens"]
    tt.dtype = pb.DTYPE_INT32
    tt.dense = np.array([4, 5, 6], "<i4").tobytes()
    w = d.loss_fn_inputs["weights"]
    w.dtype = pb.DTYPE_BFLOAT16
    w.shape.append(3)
    w.dense = (np.array([1.0, 0.5, -2.0], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    _, _, fb = decode_forward_backward_protobuf(msg.SerializeToString())
    got = fb.data[0].loss_inputs
    assert got["target_tokens"].dtype == np.int64 and got["target_tokens"].tolist() == [4, 5, 6]
    assert got["weights"].dtype == np.float32 and got["weights"].tolist() == [1.0, 0.5, -2.0]


# ---------------------------------------------------------------------------------------------
# forward_backward protobuf validation


def _base_msg() -> pb.ForwardBackwardRequest:
    d0 = datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])
    d1 = T.Datum(model_input=T.ModelInput.from_ints([5, 6, 7, 8]),
                 loss_fn_inputs={"target_tokens": np.arange(8).reshape(4, 2),
                                 "weights": torch.tensor([[0.0, 0.0], [1.0, 0.0],
                                                          [0.0, 0.0], [0.0, 0.0]])})
    body, _ = sdk_forward_backward([d0, d1])
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert msg.data[1].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    return msg


def _i64(xs) -> bytes:
    return np.asarray(xs, "<i8").tobytes()


def _mut_empty_model_id(m):
    m.model_id = ""


def _mut_no_data(m):
    del m.data[:]


def _mut_zero_tokens(m):
    del m.data[1].model_input[:]


def _mut_image_chunk(m):
    c = m.data[0].model_input.add()
    c.image.data = b"\x89PNG"
    c.image.format = "png"


def _mut_dmel_chunk(m):
    m.data[1].model_input.add().dmel.dmel = b"\x00"


def _mut_empty_chunk(m):
    m.data[0].model_input.add()


def _mut_ragged_token_bytes(m):
    m.data[0].model_input[0].encoded_text.tokens += b"\x01"


def _mut_negative_token(m):
    m.data[0].model_input[0].encoded_text.tokens = np.array([1, -2, 3], "<i4").tobytes()


def _mut_dense_bytes_vs_shape(m):
    m.data[0].loss_fn_inputs["weights"].dense = np.ones(2, "<f4").tobytes()


def _mut_dense_not_whole_values(m):
    t = m.data[0].loss_fn_inputs["weights"]
    del t.shape[:]
    t.dense = b"\x00" * 10


def _mut_unknown_dtype(m):
    m.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_UNSPECIFIED


def _mut_float_targets(m):
    t = m.data[0].loss_fn_inputs["target_tokens"]
    t.dtype = pb.DTYPE_FLOAT32
    t.dense = np.ones(3, "<f4").tobytes()


def _mut_rows_vs_tokens(m):
    t = m.data[1].loss_fn_inputs["target_tokens"]
    del t.shape[:]
    t.shape.extend([3, 2])
    t.dense = _i64(np.arange(6))


def _mut_rows_vs_tokens_1d(m):
    t = m.data[0].loss_fn_inputs["target_tokens"]
    del t.shape[:]
    t.dense = _i64([1, 2])


def _mut_negative_dim(m):
    t = m.data[0].loss_fn_inputs["weights"]
    del t.shape[:]
    t.shape.extend([-3])


def _mut_csr_crow_length(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.crow_indices = _i64([0, 0, 1, 1])


def _mut_csr_crow_decreasing(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.crow_indices = _i64([0, 1, 0, 1, 1])


def _mut_csr_crow_end(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.crow_indices = _i64([0, 0, 0, 0, 0])


def _mut_csr_col_range(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.col_indices = _i64([2])


def _mut_csr_col_count(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.col_indices = _i64([0, 1])


def _mut_csr_duplicate(m):
    csr = m.data[1].loss_fn_inputs["weights"].sparse_csr
    csr.values = np.array([1.0, 2.0], "<f4").tobytes()
    csr.crow_indices = _i64([0, 0, 2, 2, 2])
    csr.col_indices = _i64([1, 1])


def _mut_csr_ragged_index_bytes(m):
    m.data[1].loss_fn_inputs["weights"].sparse_csr.crow_indices += b"\x00"


def _mut_csr_no_shape(m):
    del m.data[1].loss_fn_inputs["weights"].shape[:]


def _mut_csr_3d(m):
    t = m.data[1].loss_fn_inputs["weights"]
    del t.shape[:]
    t.shape.extend([4, 2, 1])


def _mut_csr_rows(m):
    t = m.data[1].loss_fn_inputs["weights"]
    del t.shape[:]
    t.shape.extend([5, 2])


def _mut_config_v2_unset(m):
    m.loss_fn_config_v2["beta"].Clear()
    m.loss_fn_config_v2["beta"].SetInParent()


def _mut_span_tiling(m):
    s = m.data[0].model_input_spans.add()
    s.prompt_tokens.sequence_id = "x"
    s.prompt_tokens.length = 2


def _mut_span_empty(m):
    m.data[0].loss_fn_input_spans.add()


def _mut_span_no_sequence(m):
    m.data[0].model_input_spans.add().sampled_tokens.length = 3


def _mut_negative_seq_id(m):
    m.seq_id = -1


PROTO_ERRORS = [
    (_mut_empty_model_id, "model_id is empty"),
    (_mut_no_data, "data is empty"),
    (_mut_zero_tokens, "data[1].model_input has no tokens"),
    (_mut_image_chunk, "data[0].model_input[1].data is not a png image"),
    (_mut_dmel_chunk, "data[1].model_input[1] is a 'dmel' chunk"),
    (_mut_empty_chunk, "data[0].model_input[1] is an empty chunk"),
    (_mut_ragged_token_bytes, "data[0].model_input[0].tokens has 13 bytes"),
    (_mut_negative_token, "data[0].model_input has a negative token id"),
    (_mut_dense_bytes_vs_shape,
     "data[0].loss_fn_inputs['weights'] has 8 bytes of float32 data but its shape [3] needs 12"),
    (_mut_dense_not_whole_values, "data[0].loss_fn_inputs['weights'] has 10 bytes"),
    (_mut_unknown_dtype, "data[0].loss_fn_inputs['weights'] has unknown dtype"),
    (_mut_float_targets, "data[0].loss_fn_inputs['target_tokens'] must be an integer tensor"),
    (_mut_rows_vs_tokens,
     "data[1].loss_fn_inputs['target_tokens'] has 3 rows but model_input has 4 tokens"),
    (_mut_rows_vs_tokens_1d,
     "data[0].loss_fn_inputs['target_tokens'] has 2 rows but model_input has 3 tokens"),
    (_mut_negative_dim, "data[0].loss_fn_inputs['weights'].shape [-3] has a negative dimension"),
    (_mut_csr_crow_length, "data[1].loss_fn_inputs['weights']: sparse crow_indices has 4 entries"),
    (_mut_csr_crow_decreasing, "data[1].loss_fn_inputs['weights']: sparse crow_indices must"),
    (_mut_csr_crow_end, "data[1].loss_fn_inputs['weights']: sparse crow_indices must"),
    (_mut_csr_col_range, "data[1].loss_fn_inputs['weights']: sparse col_indices out of range"),
    (_mut_csr_col_count, "data[1].loss_fn_inputs['weights']: sparse col_indices has 2 entries"),
    (_mut_csr_duplicate, "data[1].loss_fn_inputs['weights']: sparse col_indices list the same"),
    (_mut_csr_ragged_index_bytes, "data[1].loss_fn_inputs['weights'].sparse_csr.crow_indices has"),
    (_mut_csr_no_shape, "data[1].loss_fn_inputs['weights'] is sparse CSR but has no shape"),
    (_mut_csr_3d, "data[1].loss_fn_inputs['weights'] is sparse CSR with shape [4, 2, 1]"),
    (_mut_csr_rows, "data[1].loss_fn_inputs['weights'] has 5 rows but model_input has 4 tokens"),
    (_mut_config_v2_unset, "loss_fn_config_v2['beta']"),
    (_mut_span_tiling, "data[0].model_input_spans cover 2 positions but model_input has 3"),
    (_mut_span_empty, "data[0].loss_fn_input_spans[0] is neither"),
    (_mut_span_no_sequence, "data[0].model_input_spans[0].sequence_id"),
    (_mut_negative_seq_id, "seq_id must be >= 0"),
]


@pytest.mark.parametrize("mutate,message", PROTO_ERRORS, ids=[m.__name__[5:] for m, _ in PROTO_ERRORS])
def test_protobuf_validation_errors(mutate, message):
    msg = _base_msg()
    decode_forward_backward_protobuf(msg.SerializeToString())  # the base is valid
    mutate(msg)
    with pytest.raises(InvalidInputError) as err:
        decode_forward_backward_protobuf(msg.SerializeToString())
    assert message in str(err.value)
    assert err.value.status == 400


@pytest.mark.parametrize("body,encoding,message", [
    (b"\xff\xff\xff\xff", None, "not a valid ForwardBackwardRequest"),
    (b"not zstd at all", "zstd", "not valid zstd"),
    (b"", "br", "Content-Encoding 'br' is not supported"),
])
def test_protobuf_undecodable_bodies(body, encoding, message):
    with pytest.raises(InvalidInputError, match=message):
        decode_posted(body, encoding)


def test_protobuf_does_not_validate_loss_names_or_required_keys():
    d = datum([1, 2], advantages=[1.0, 2.0])  # no target_tokens at all
    msg = pb.ForwardBackwardRequest.FromString(sdk_forward_backward([d])[0])
    msg.loss_fn = "no_such_loss"
    _, _, fb = decode_forward_backward_protobuf(msg.SerializeToString())
    assert fb.loss_fn == "no_such_loss" and set(fb.data[0].loss_inputs) == {"advantages"}


# ---------------------------------------------------------------------------------------------
# forward_backward results, decoded by the SDK's own code


def test_output_protobuf_1d_decoded_by_sdk():
    result = ForwardBackwardResult(
        outputs=[{"logprobs": np.float32([-0.5, -1.25, -2.0]),
                  "elementwise_loss": np.float32([0.5, 1.25, 2.0])},
                 {"logprobs": np.float32([-3.0]), "elementwise_loss": np.float32([3.0])}],
        metrics={"loss:sum": 6.75, "n_tokens:sum": 4.0})
    body = encode_forward_backward_output_protobuf(result)
    out = deserialize_forward_backward_output(body)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == {"loss:sum": 6.75, "n_tokens:sum": 4.0}
    assert len(out.loss_fn_outputs) == 2
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.dtype == "float32" and lp.shape == [3]
    assert lp.tolist() == [-0.5, -1.25, -2.0]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [3.0]
    msg = pb.ForwardBackwardOutput.FromString(body)
    assert len(msg.loss_fn_outputs) == 1 and msg.loss_fn_outputs[0].num_datums == 2
    bt = msg.loss_fn_outputs[0].fields["logprobs"]
    assert np.frombuffer(bt.offsets, "<i8").tolist() == [0, 12, 16]  # byte offsets
    assert list(bt.trailing_shape) == []


def test_output_protobuf_2d_logprobs_shape():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal((2, 3)).astype(np.float32)
    body = encode_forward_backward_output_protobuf(
        ForwardBackwardResult(outputs=[{"logprobs": a}, {"logprobs": b}],
                              metrics={"loss:sum": 1.0}))
    out = deserialize_forward_backward_output(body)
    assert out.loss_fn_outputs[0]["logprobs"].shape == [5, 3]
    assert out.loss_fn_outputs[1]["logprobs"].shape == [2, 3]
    np.testing.assert_array_equal(out.loss_fn_outputs[0]["logprobs"].to_numpy(), a)
    np.testing.assert_array_equal(out.loss_fn_outputs[1]["logprobs"].to_numpy(), b)
    assert list(pb.ForwardBackwardOutput.FromString(body)
                .loss_fn_outputs[0].fields["logprobs"].trailing_shape) == [3]


def test_output_protobuf_mixed_shapes_and_integer_fields():
    outputs = [{"logprobs": np.float32([-1.0, -2.0]), "ids": np.array([3, 4])},
               {"logprobs": np.full((3, 2), -0.5, np.float32), "ids": np.array([[1, 2]] * 3)},
               {"logprobs": np.float64([-7.0]), "ids": np.array([9], np.int32)}]
    body = encode_forward_backward_output_protobuf(
        ForwardBackwardResult(outputs=outputs, metrics={"loss:sum": 0.0}))
    assert len(pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs) == 3
    out = deserialize_forward_backward_output(body)
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[2], [3, 2], [1]]
    assert [o["ids"].dtype for o in out.loss_fn_outputs] == ["int64"] * 3
    assert out.loss_fn_outputs[1]["ids"].tolist() == [[1, 2]] * 3
    assert out.loss_fn_outputs[2]["logprobs"].tolist() == [-7.0]


@pytest.mark.parametrize("key", ["loss", "loss:sum:mean", ""])
def test_output_metric_keys_need_exactly_one_colon(key):
    result = ForwardBackwardResult(outputs=[{"logprobs": np.zeros(1, np.float32)}],
                                   metrics={"loss:sum": 0.0, key: 1.0})
    with pytest.raises(ValueError, match="exactly one ':'"):
        encode_forward_backward_output_protobuf(result)
    with pytest.raises(ValueError, match="exactly one ':'"):
        encode_forward_backward_output_json(result)


def test_output_fields_must_agree_across_datums():
    result = ForwardBackwardResult(outputs=[{"logprobs": np.zeros(1, np.float32)},
                                            {"other": np.zeros(1, np.float32)}], metrics={})
    with pytest.raises(ValueError, match="same output fields"):
        encode_forward_backward_output_protobuf(result)


def test_output_json_shape():
    result = ForwardBackwardResult(
        outputs=[{"logprobs": np.float32([[-0.1, -np.inf], [-2.0, -3.0]])}],
        metrics={"loss:sum": float("nan"), "n:sum": 2.0})
    out = encode_forward_backward_output_json(result)
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON
    assert out["loss_fn_output_type"] == "ArrayRecord"
    assert out["metrics"] == {"loss:sum": "NaN", "n:sum": 2.0}
    td = out["loss_fn_outputs"][0]["logprobs"]
    assert td["dtype"] == "float32" and td["shape"] == [2, 2]
    assert td["data"] == [float(np.float32(-0.1)), "-Infinity", -2.0, -3.0]


# ---------------------------------------------------------------------------------------------
# asample requests and results


def test_sample_request_from_sdk_038():
    body = sdk_asample(
        num_samples=3, prompt=T.ModelInput.from_ints([7, 8, 9, 10]),
        sampling_params=T.SamplingParams(max_tokens=16, temperature=0.7, top_k=50, top_p=0.95,
                                         seed=2**63 - 1, stop="</s>"),
        prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2,
        prompt_logprobs_last_n=2, record_stability_info=True, seq_id=12)
    sid, seq_id, base_model, model_path, si = decode_sample_request_json(body)
    assert (sid, seq_id, base_model, model_path) == ("sess:sample:0", 12, None, None)
    assert si.prompt.dtype == np.int64 and si.prompt.tolist() == [7, 8, 9, 10]
    assert si.num_samples == 3
    p = si.params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 0.7, 50, 0.95, 2**63 - 1)
    assert p.stop == ["</s>"]
    assert si.prompt_logprobs and si.topk_prompt_logprobs == 3 and si.topk_sample_logprobs == 2
    assert si.prompt_logprobs_last_n == 2 and si.record_stability_info


@pytest.mark.parametrize("stop,expected", [
    (None, None), ([], []), (["a", "bc"], ["a", "bc"]), ([13, 2], [13, 2]), ("\n", ["\n"]),
])
def test_sample_request_stop_forms_and_defaults(stop, expected):
    body = sdk_asample(sampling_params=T.SamplingParams(stop=stop, seed=-3))
    *_, si = decode_sample_request_json(body)
    assert si.params.stop == expected
    assert (si.params.max_tokens, si.params.temperature, si.params.top_k, si.params.top_p) == (
        None, 1.0, -1, 1.0)
    assert si.params.seed == -3
    assert si.num_samples == 1 and not si.prompt_logprobs and si.prompt_logprobs_last_n is None


def test_sample_request_base_model_form():
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 3}, "base_model": "Qwen/Qwen3-0.6B"}
    sid, seq_id, base_model, model_path, si = decode_sample_request_json(body)
    assert (sid, seq_id, base_model, model_path) == (None, None, "Qwen/Qwen3-0.6B", None)
    body = {**body, "base_model": None, "model_path": "tinker://r:train:0/sampler_weights/s"}
    assert decode_sample_request_json(body)[3] == "tinker://r:train:0/sampler_weights/s"


def _sample_body() -> dict:
    return sdk_asample(prompt=T.ModelInput.from_ints([1, 2, 3]),
                       sampling_params=T.SamplingParams(max_tokens=4))


def _set(path, value):
    def mutate(body):
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    mutate.__name__ = ".".join(map(str, path))
    return mutate


def _append(path, value):
    def mutate(body):
        node = body
        for key in path:
            node = node[key]
        node.append(value)
    mutate.__name__ = ".".join(map(str, path)) + ".append"
    return mutate


SAMPLE_ERRORS = [
    (_set(["prompt", "chunks"], []), "prompt has no tokens"),
    (_set(["prompt", "chunks", 0, "tokens"], [1, 2.5]), "prompt.chunks[0].tokens must contain integers"),
    (_set(["prompt", "chunks", 0, "tokens"], [1, "2"]), "prompt.chunks[0].tokens must contain only integers"),
    (_set(["prompt", "chunks", 0, "tokens"], [1, True]), "prompt.chunks[0].tokens must contain only integers"),
    (_set(["prompt", "chunks", 0, "tokens"], [-1]), "prompt has a negative token id"),
    (_append(["prompt", "chunks"], {"type": "image", "data": "aGk=", "format": "png"}),
     "prompt.chunks[1].data is not a png image"),
    (_set(["prompt", "chunks", 0], {"type": "image_asset_pointer", "location": "x", "format": "png"}),
     "prompt.chunks[0] is a 'image_asset_pointer' chunk"),
    (_set(["num_samples"], 0), "num_samples must be >= 1"),
    (_set(["sampling_params", "max_tokens"], 0), "sampling_params.max_tokens must be > 0"),
    (_set(["sampling_params", "max_tokens"], 2.0), "sampling_params.max_tokens must be an integer"),
    (_set(["sampling_params", "temperature"], -0.1), "sampling_params.temperature must be >= 0"),
    (_set(["sampling_params", "top_p"], 0.0), "sampling_params.top_p must be in (0, 1]"),
    (_set(["sampling_params", "top_p"], 1.5), "sampling_params.top_p must be in (0, 1]"),
    (_set(["sampling_params", "top_k"], 0), "sampling_params.top_k must be -1"),
    (_set(["sampling_params", "top_k"], -2), "sampling_params.top_k must be -1"),
    (_set(["sampling_params", "stop"], ["a", 3]), "sampling_params.stop mixes strings and token ids"),
    (_set(["sampling_params", "stop"], [1.5]), "sampling_params.stop must contain only"),
    (_set(["sampling_params", "stop"], 5), "sampling_params.stop must be a string"),
    (_set(["sampling_params", "stop"], ["a", ""]), "sampling_params.stop[1] is an empty string"),
    (_set(["sampling_params", "stop"], [-4]), "sampling_params.stop[0] is a negative token id"),
    (_set(["sampling_params", "seed"], 2**64), "sampling_params.seed must fit in 64 bits"),
    (_set(["topk_prompt_logprobs"], -1), "topk_prompt_logprobs must be >= 0"),
    (_set(["topk_sample_logprobs"], -2), "topk_sample_logprobs must be >= 0"),
    (_set(["prompt_logprobs_last_n"], 1), "prompt_logprobs_last_n requires prompt_logprobs"),
    (_set(["prompt_alt_tokens_k"], -1), "prompt_alt_tokens_k must be >= 0"),
    (_set(["prompt_alt_tokens_k"], 1.5), "prompt_alt_tokens_k must be an integer"),
    (_set(["target_prompt_logprobs"], {"data": [1], "dtype": "int64", "shape": [2, 1]}),
     "target_prompt_logprobs has 1 values but its shape [2, 1] needs 2"),
    (_set(["target_prompt_logprobs"], {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}),
     "target_prompt_logprobs has 3 rows but len(prompt) - 1 = 2"),
    (_set(["target_prompt_logprobs"], {"data": [1, 2], "dtype": "int64", "shape": [2]}),
     "target_prompt_logprobs.shape must be [len(prompt) - 1, K]"),
    (_set(["target_prompt_logprobs"], {"data": [1.0, 2.0], "dtype": "float32", "shape": [2, 1]}),
     "target_prompt_logprobs must hold int64 token ids"),
    (_set(["target_prompt_logprobs"], {"data": [-1, -1], "dtype": "int64", "shape": [2, 1]}),
     "target_prompt_logprobs names no token id"),
    (_set(["target_prompt_logprobs"], {"data": [-3, 1], "dtype": "int64", "shape": [2, 1]}),
     "target_prompt_logprobs holds ids below -1"),
    (_set(["target_prompt_logprobs"], {"data": [4], "dtype": "int64", "shape": [2, 3],
                                       "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}),
     "target_prompt_logprobs: sparse crow_indices has 2 entries but shape [2, 3] needs 3"),
    (_set(["sampling_session_id"], None), "one of sampling_session_id, base_model or model_path"),
    (_set(["seq_id"], None), "seq_id is required with sampling_session_id"),
    (_set(["prompt_logprobs"], "yes"), "prompt_logprobs must be true or false"),
]


@pytest.mark.parametrize("mutate,message", SAMPLE_ERRORS,
                         ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(SAMPLE_ERRORS)])
def test_sample_request_validation_errors(mutate, message):
    body = _sample_body()
    decode_sample_request_json(copy.deepcopy(body))  # the base is valid
    mutate(body)
    with pytest.raises(InvalidInputError) as err:
        decode_sample_request_json(body)
    assert message in str(err.value)


def test_sample_request_target_prompt_ids_sparse_and_dense():
    body = _sample_body()  # a 3-token prompt: 2 scored positions
    body["target_prompt_logprobs"] = {"data": [4, 9], "dtype": "int64", "shape": [2, 3],
                                      "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [2, 0]}
    body["prompt_alt_tokens_k"] = 3
    inp = decode_sample_request_json(body)[4]
    assert inp.target_prompt_ids.tolist() == [[-1, -1, 4], [9, -1, -1]]  # unlisted cells are -1
    crow, col = inp.target_prompt_csr
    assert crow.tolist() == [0, 1, 2] and col.tolist() == [2, 0]
    assert inp.prompt_alt_tokens_k == 3
    body["target_prompt_logprobs"] = {"data": [4, -1], "dtype": "int64", "shape": [2, 1]}
    inp = decode_sample_request_json(body)[4]
    assert inp.target_prompt_ids.tolist() == [[4], [-1]] and inp.target_prompt_csr is None


def test_sample_request_last_n_range():
    body = _sample_body()
    body["prompt_logprobs"] = True
    body["prompt_logprobs_last_n"] = 3  # prompt has 3 tokens: 1..2 allowed
    with pytest.raises(InvalidInputError, match="prompt_logprobs_last_n must be between 1 and"):
        decode_sample_request_json(body)
    body["prompt_logprobs_last_n"] = 2
    assert decode_sample_request_json(body)[4].prompt_logprobs_last_n == 2


def _sample_result() -> SampleResult:
    topk_ids = np.array([[5, 6, 7], [8, 9, 0], [4, 0, 0]], np.int32)
    topk_lps = np.array([[-0.1, -2.0, -3.0], [-0.2, -4.0, -np.inf], [-0.3, np.nan, np.nan]],
                        np.float32)
    return SampleResult(
        sequences=[
            SampledSequence(tokens=np.array([5, 8, 4], np.int32),
                            logprobs=np.float32([-0.1, -0.2, -0.3]), stop_reason="stop",
                            topk_token_ids=topk_ids, topk_logprobs=topk_lps),
            SampledSequence(tokens=np.array([1, 2, 3, 4], np.int32),
                            logprobs=np.float32([-1.0, -1.5, -2.0, -np.inf]),
                            stop_reason="length"),
        ],
        prompt_logprobs=np.float32([np.nan, -1.5, -0.25]),
        topk_prompt_token_ids=np.array([[0, 0], [11, 12], [13, 0]], np.int32),
        topk_prompt_logprobs=np.array([[np.nan, np.nan], [-0.5, -1.0], [-0.1, -np.inf]],
                                      np.float32),
        prompt_cache_hit_tokens=2,
    )


def test_sample_response_protobuf_decoded_by_sdk():
    resp = deserialize_sample_response(encode_sample_response_protobuf(_sample_result()))
    s0, s1 = resp.sequences
    assert s0.stop_reason == "stop" and s1.stop_reason == "length"
    assert s0.tokens == [5, 8, 4] and s1.tokens == [1, 2, 3, 4]
    assert s0.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert s1.logprobs[:3] == [-1.0, -1.5, -2.0] and s1.logprobs[3] == -math.inf
    assert s0.topk_logprobs_np is not None and s0.topk_logprobs_np.token_ids.shape == (3, 3)
    rows = s0.topk_logprobs
    assert [t for t, _ in rows[0]] == [5, 6, 7]
    assert [t for t, _ in rows[1]] == [8, 9]  # absent entry trimmed
    assert [t for t, _ in rows[2]] == [4]
    assert s1.topk_logprobs is None  # k == 0
    assert resp.prompt_logprobs[0] is None
    assert resp.prompt_logprobs[1:] == [-1.5, -0.25]
    topk = resp.topk_prompt_logprobs
    assert topk[0] is None
    assert [t for t, _ in topk[1]] == [11, 12] and [t for t, _ in topk[2]] == [13]
    assert resp.prompt_cache_hit_tokens == 2


def test_sample_response_protobuf_minimal():
    result = SampleResult(sequences=[SampledSequence(tokens=np.array([3], np.int32),
                                                     logprobs=np.float32([-0.7]),
                                                     stop_reason="stop",
                                                     topk_token_ids=np.zeros((1, 0), np.int32),
                                                     topk_logprobs=np.zeros((1, 0), np.float32))])
    resp = deserialize_sample_response(encode_sample_response_protobuf(result))
    assert resp.prompt_logprobs is None and resp.topk_prompt_logprobs is None
    assert resp.sequences[0].topk_logprobs is None
    assert resp.sequences[0].logprobs == pytest.approx([-0.7])
    msg = pb.SampleResponse.FromString(encode_sample_response_protobuf(result))
    assert not msg.sequences[0].HasField("topk_sampled_logprobs")


def test_sample_response_rejects_inconsistent_results():
    bad = SampleResult(sequences=[SampledSequence(tokens=np.array([1, 2], np.int32),
                                                  logprobs=np.float32([-1.0]),
                                                  stop_reason="stop")])
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        encode_sample_response_protobuf(bad)


def test_sample_response_json_shape():
    out = encode_sample_response_json(_sample_result())
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON
    assert out["type"] == "sample"
    assert out["sequences"][0] == {"stop_reason": "stop", "tokens": [5, 8, 4],
                                   "logprobs": [float(np.float32(x)) for x in (-0.1, -0.2, -0.3)]}
    assert out["sequences"][1]["logprobs"][3] == "-Infinity"
    assert out["prompt_logprobs"] == [None, -1.5, -0.25]
    assert out["topk_prompt_logprobs"] == [None, [[11, -0.5], [12, -1.0]],
                                           [[13, float(np.float32(-0.1))]]]


# ---------------------------------------------------------------------------------------------
# JSON generation (SDK <= 0.22.2)

# Hand-written from tinker 0.22.2: types/_pydantic_types/{forward_backward_request,
# forward_request, forward_backward_input, datum, tensor_data, model_input}.py,
# lib/_pydantic_conv.py (to_pydantic_request) and resources/training.py, which posts
# model_dump(exclude_none=True, mode="json") to /api/v1/forward_backward and /api/v1/forward.
FB_JSON_0222 = {
    "forward_backward_input": {
        "data": [
            {"loss_fn_inputs": {
                "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                "weights": {"data": [1.0, 0.0, 1.0], "dtype": "float32", "shape": [3]}},
             "model_input": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]}},
            {"loss_fn_inputs": {
                "target_tokens": {"data": [7, 8, 9, 10], "dtype": "int64", "shape": [2, 2]},
                "weights": {"data": [0.5], "dtype": "float32", "shape": [2, 2],
                            "sparse_crow_indices": [0, 0, 1], "sparse_col_indices": [1]}},
             "model_input": {"chunks": [{"tokens": [5], "type": "encoded_text"},
                                        {"tokens": [6], "type": "encoded_text"}]}},
        ],
        "loss_fn": "cross_entropy",
        "loss_fn_config": {"clip_low_threshold": 0.9},
    },
    "model_id": "m:train:0",
    "seq_id": 3,
}


def test_json_forward_backward_fixture_0222():
    model_id, seq_id, fb = decode_forward_backward_json(copy.deepcopy(FB_JSON_0222))
    assert (model_id, seq_id, fb.loss_fn, fb.forward_only) == ("m:train:0", 3, "cross_entropy", False)
    assert fb.loss_fn_config == {"clip_low_threshold": 0.9}
    a, b = fb.data
    assert a.tokens.tolist() == [1, 2, 3] and a.loss_inputs["target_tokens"].dtype == np.int64
    assert a.loss_inputs["weights"].dtype == np.float32
    assert b.tokens.tolist() == [5, 6]
    assert b.loss_inputs["target_tokens"].tolist() == [[7, 8], [9, 10]]
    np.testing.assert_array_equal(b.loss_inputs["weights"], np.float32([[0, 0], [0, 0.5]]))


def test_json_forward_endpoint_body_sets_forward_only():
    body = copy.deepcopy(FB_JSON_0222)
    body["forward_input"] = body.pop("forward_backward_input")
    del body["forward_input"]["loss_fn_config"]
    _, _, fb = decode_forward_backward_json(body)
    assert fb.forward_only is True and fb.loss_fn_config == {}


def test_json_empty_shape_and_string_config():
    body = copy.deepcopy(FB_JSON_0222)
    del body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["shape"]
    del body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"]
    body["forward_backward_input"]["loss_fn_config"] = {"loss_id": "x", "beta": 1}
    _, _, fb = decode_forward_backward_json(body)
    assert fb.data[0].loss_inputs["target_tokens"].shape == (3,)
    assert "weights" not in fb.data[0].loss_inputs
    assert fb.loss_fn_config == {"loss_id": "x", "beta": 1.0}


def _jset(path, value):
    def mutate(body):
        node = body
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return mutate


_DELETE = object()
_D = ["forward_backward_input", "data"]
_TT0 = _D + [0, "loss_fn_inputs", "target_tokens"]
_W1 = _D + [1, "loss_fn_inputs", "weights"]

JSON_ERRORS = [
    (_jset(["forward_backward_input"], _DELETE), "forward_backward_input is missing"),
    (_jset(["model_id"], ""), "model_id is missing or empty"),
    (_jset(["seq_id"], "3"), "seq_id must be an integer"),
    (_jset(_D, []), "data is empty"),
    (_jset(["forward_backward_input", "loss_fn"], None), "forward_backward_input.loss_fn must be"),
    (_jset(["forward_backward_input", "loss_fn_config"], {"a": [1]}),
     "forward_backward_input.loss_fn_config['a'] must be a number or a string"),
    (_jset(_D + [1, "model_input", "chunks"], []), "data[1].model_input has no tokens"),
    (_jset(_D + [0, "model_input", "chunks", 0, "tokens"], [1, 2.5, 3]),
     "data[0].model_input.chunks[0].tokens must contain integers"),
    (_jset(_D + [1, "model_input", "chunks", 1], {"type": "image", "data": "", "format": "png"}),
     "data[1].model_input.chunks[1].data is empty"),
    (_jset(_TT0 + ["dtype"], "float64"), "data[0].loss_fn_inputs['target_tokens'] has unknown dtype"),
    (_jset(_TT0 + ["dtype"], "float32"),
     "data[0].loss_fn_inputs['target_tokens'] must be an integer tensor"),
    (_jset(_TT0 + ["data"], [2, 3.5, 4]),
     "data[0].loss_fn_inputs['target_tokens'].data must contain integers"),
    (_jset(_TT0 + ["data"], [2, 3]),
     "data[0].loss_fn_inputs['target_tokens'] has 2 values but its shape [3] needs 3"),
    (_jset(_TT0 + ["shape"], [1, 3]),
     "data[0].loss_fn_inputs['target_tokens'] has 1 rows but model_input has 3 tokens"),
    (_jset(_TT0 + ["shape"], "3"), "data[0].loss_fn_inputs['target_tokens'].shape must be a list"),
    (_jset(_D + [0, "loss_fn_inputs", "weights", "data"], [1.0, "x", 1.0]),
     "data[0].loss_fn_inputs['weights'].data[1] is not a number"),
    (_jset(_W1 + ["sparse_crow_indices"], [0, 1, 0]),
     "data[1].loss_fn_inputs['weights']: sparse crow_indices must"),
    (_jset(_W1 + ["sparse_col_indices"], [2]),
     "data[1].loss_fn_inputs['weights']: sparse col_indices out of range"),
    (_jset(_W1 + ["sparse_col_indices"], _DELETE),
     "data[1].loss_fn_inputs['weights'] has sparse row pointers"),
    (_jset(_W1 + ["shape"], _DELETE), "data[1].loss_fn_inputs['weights'] is sparse CSR but has no"),
    (_jset(_W1 + ["dtype"], None), "data[1].loss_fn_inputs['weights'] has unknown dtype"),
]


@pytest.mark.parametrize("mutate,message", JSON_ERRORS,
                         ids=[str(i) for i in range(len(JSON_ERRORS))])
def test_json_validation_errors(mutate, message):
    body = copy.deepcopy(FB_JSON_0222)
    mutate(body)
    with pytest.raises(InvalidInputError) as err:
        decode_forward_backward_json(body)
    assert message in str(err.value)


def test_json_float_strings_accepted():
    body = copy.deepcopy(FB_JSON_0222)
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"]["data"] = [
        "NaN", "-Infinity", 1]
    _, _, fb = decode_forward_backward_json(body)
    w = fb.data[0].loss_inputs["weights"]
    assert math.isnan(w[0]) and w[1] == -np.inf and w[2] == 1.0


@pytest.fixture(scope="module")
def sdk0222():
    if not SDK0222_PYTHON.exists():
        pytest.skip(f"{SDK0222_PYTHON} is missing (scripts/setup creates it with tinker==0.22.2)")

    def run(*args, stdin=None):
        proc = subprocess.run([str(SDK0222_PYTHON), str(PROBE), *args], input=stdin,
                              capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    return run


def test_sdk0222_request_bodies_decode(sdk0222):
    reqs = sdk0222("requests")
    fb = reqs["forward_backward"]
    assert fb["path"] == "/api/v1/forward_backward"
    model_id, seq_id, inp = decode_forward_backward_json(fb["body"])
    assert (model_id, seq_id, inp.loss_fn, inp.forward_only) == ("s:train:0", 3, "cross_entropy", False)
    assert inp.loss_fn_config == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    d0, d1, d2 = inp.data
    assert d0.tokens.tolist() == [11, 12, 13, 14]
    assert d0.loss_inputs["target_tokens"].tolist() == [12, 13, 14, 15]
    np.testing.assert_array_equal(d0.loss_inputs["weights"], np.float32([0, 1, 1, 0.5]))
    assert d1.tokens.tolist() == [1, 2, 3]
    assert d1.loss_inputs["target_tokens"].tolist() == [[5, 6], [7, 8], [9, 10]]
    np.testing.assert_array_equal(d1.loss_inputs["weights"],
                                  np.float32([[0.75, 0], [0, 0], [0, 0.25]]))
    assert d2.loss_inputs["target_tokens"].tolist() == [8, 9]

    # The same call as protobuf (0.22.2 with proto_write_fwdbwd; its schema has no forward_only).
    _, _, from_proto = decode_forward_backward_protobuf(
        base64.b64decode(reqs["forward_backward_proto"]["body"]))
    assert from_proto.loss_fn_config == inp.loss_fn_config and not from_proto.forward_only
    for a, b in zip(from_proto.data, inp.data):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.loss_inputs.keys() == b.loss_inputs.keys()
        for key in a.loss_inputs:
            np.testing.assert_array_equal(a.loss_inputs[key], b.loss_inputs[key])
            assert a.loss_inputs[key].dtype == b.loss_inputs[key].dtype

    fwd = reqs["forward"]
    assert fwd["path"] == "/api/v1/forward"
    model_id, seq_id, inp = decode_forward_backward_json(fwd["body"])
    assert (seq_id, inp.forward_only, inp.loss_fn) == (4, True, "cross_entropy")

    sample = reqs["asample_logprobs"]
    assert sample["path"] == "/api/v1/asample"
    sid, seq_id, base_model, model_path, si = decode_sample_request_json(sample["body"])
    assert (sid, seq_id, base_model, model_path) == ("s:sample:0", 0, None, None)
    assert si.num_samples == 2 and si.prompt.tolist() == [5, 6, 7]
    assert si.params.stop == ["\n"] and si.params.max_tokens == 4 and si.params.seed == -5
    assert si.prompt_logprobs and si.topk_prompt_logprobs == 2 and si.topk_sample_logprobs == 0
    *_, si = decode_sample_request_json(reqs["asample_plain"]["body"])
    assert si.params.stop == [3, 4] and si.params.max_tokens is None
    assert (si.params.temperature, si.params.top_k, si.params.top_p) == (0.5, 20, 0.9)


def test_sdk0222_parses_our_results(sdk0222):
    metrics = {"loss:sum": 21.5, "z:mean": float("nan")}
    # JSON carries a full shape per datum, so (N,) and (N, K) outputs may be mixed.
    mixed = ForwardBackwardResult(
        outputs=[{"logprobs": np.float32([-0.5, -np.inf]), "elementwise_loss": np.float32([0.5, 1])},
                 {"logprobs": np.float32([[-1, -2], [-3, -4], [-5, -6]]),
                  "elementwise_loss": np.float32([[1, 2], [3, 4], [5, 6]])}],
        metrics=metrics)
    # 0.22.2's protobuf reader applies the first record's trailing shape to every record
    # (0.38.0 reads it per record), so protobuf for 0.22.2 is only exact for uniform layouts.
    uniform = ForwardBackwardResult(
        outputs=[{"logprobs": np.float32([[-0.5, -np.inf]]), "elementwise_loss": np.float32([[0.5, 1]])},
                 {"logprobs": np.float32([[-1, -2], [-3, -4], [-5, -6]]),
                  "elementwise_loss": np.float32([[1, 2], [3, 4], [5, 6]])}],
        metrics=metrics)
    payload = {
        "fb_json": encode_forward_backward_output_json(mixed),
        "fb_proto": base64.b64encode(encode_forward_backward_output_protobuf(uniform)).decode(),
        "sample_json": encode_sample_response_json(_sample_result()),
        "sample_proto": base64.b64encode(encode_sample_response_protobuf(_sample_result())).decode(),
    }
    seen = sdk0222("parse", stdin=json.dumps(payload, allow_nan=False))
    for key in ("fb_json", "fb_proto"):
        fb = seen[key]
        assert fb["loss_fn_output_type"] == "ArrayRecord", key
        assert fb["metrics"] == {"loss:sum": 21.5, "z:mean": "nan"}, key
        o0, o1 = fb["outputs"]
        shape0 = [2] if key == "fb_json" else [1, 2]
        assert o0["logprobs"] == {"dtype": "float32", "shape": shape0, "data": [-0.5, "-inf"]}, key
        assert o1["logprobs"]["shape"] == [3, 2], key
        assert o1["elementwise_loss"]["data"] == [1, 2, 3, 4, 5, 6], key
    for key in ("sample_json", "sample_proto"):
        sr = seen[key]
        assert [s["stop_reason"] for s in sr["sequences"]] == ["stop", "length"], key
        assert sr["sequences"][0]["tokens"] == [5, 8, 4], key
        assert sr["sequences"][1]["logprobs"] == [-1.0, -1.5, -2.0, "-inf"], key
        assert sr["prompt_logprobs"] == [None, -1.5, -0.25], key
        topk = sr["topk_prompt_logprobs"]
        assert topk[0] is None and [t for t, _ in topk[1]] == [11, 12], key
        assert [t for t, _ in topk[2]] == [13], key


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_sample_response_carries_target_and_alt_tokens_in_both_encodings():
    seq = SampledSequence(tokens=np.array([3], np.int32), logprobs=np.array([-0.5], np.float32), stop_reason="length")
    dense = np.array([[-1.5, 0.0, 0.0], [0.0, 0.0, -2.5]], np.float32)
    csr = (np.array([0, 1, 2]), np.array([0, 2]))
    result = SampleResult(sequences=[seq], target_prompt_logprobs=dense, target_prompt_csr=csr,
                          prompt_alt_tokens=np.array([[7, 8], [9, 9]]),
                          prompt_alt_logprobs=np.array([[-1.0, -2.0], [-3.0, -3.0]], np.float32))
    msg = pb.SampleResponse.FromString(encode_sample_response_protobuf(result))
    t = msg.target_prompt_logprobs
    assert t.dtype == pb.DTYPE_FLOAT32 and list(t.shape) == [2, 3]
    assert np.frombuffer(t.sparse_csr.values, np.float32).tolist() == [-1.5, -2.5]
    assert np.frombuffer(t.sparse_csr.col_indices, np.int64).tolist() == [0, 2]
    assert np.frombuffer(msg.prompt_alt_tokens.tokens.dense, np.int64).tolist() == [7, 8, 9, 9]
    assert msg.prompt_alt_tokens.tokens.dtype == pb.DTYPE_INT64
    js = encode_sample_response_json(result)
    assert js["target_prompt_logprobs"] == {"dtype": "float32", "shape": [2, 3], "data": [-1.5, -2.5],
                                            "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [0, 2]}
    assert js["prompt_alt_tokens"]["tokens"]["data"] == [7, 8, 9, 9]
    result.target_prompt_csr = None  # dense in, dense out
    msg = pb.SampleResponse.FromString(encode_sample_response_protobuf(result))
    assert np.frombuffer(msg.target_prompt_logprobs.dense, np.float32).reshape(2, 3).tolist() == dense.tolist()
