"""forward_backward / forward: request decoding (protobuf and JSON) and result encoding.

Wire generations (read from the SDK sources):

* ``tinker`` 0.38.0 posts ``POST /api/v1/forward_backward`` with a protobuf
  ``ForwardBackwardRequest`` body (``Content-Type: application/x-protobuf``, zstd-compressed
  with ``Content-Encoding: zstd`` when the client config sets ``proto_compress_fwdbwd``; the
  HTTP layer undoes the compression, see ``tinsmith.api.request``).
  ``forward()`` is the same message with ``forward_only = true``. Results must be protobuf.
* ``tinker`` 0.22.2 posts JSON by default: ``POST /api/v1/forward_backward`` with
  ``{"forward_backward_input": {...}, "model_id", "seq_id"}`` and, for ``forward()``,
  ``POST /api/v1/forward`` with ``{"forward_input": {...}, "model_id", "seq_id"}``.
  (With the client-config flag ``proto_write_fwdbwd`` it sends forward_backward as protobuf
  instead, in a schema without ``forward_only``; ``forward()`` stays JSON.) It accepts results
  as JSON or protobuf (it polls with ``Accept: application/x-protobuf, application/json``,
  while 0.38.0 sends ``Accept: application/x-protobuf`` alone). Answer 0.22.2 with JSON: its
  protobuf reader applies the first ArrayRecord's ``trailing_shape`` to every record, so a
  result mixing ``(N,)`` and ``(N, K)`` datums would come out with wrong shapes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf.message import DecodeError

from tinker.proto import tinker_public_pb2 as pb
from tinsmith.losses import inputs_read_by
from tinsmith.types import (
    Datum,
    ImageInput,
    ForwardBackwardInput,
    ForwardBackwardResult,
    LossConfigValue,
    ProvenanceSpan,
)

from ._common import (
    DenseBudget,
    check_int64,
    check_metric_keys,
    check_spans,
    check_text,
    check_token_ids,
    densify,
    fail,
    is_int,
    is_number,
    json_float,
    json_float_array,
    json_float_list,
    json_int_array,
    json_model_input,
    make_span,
    unsupported_chunk,
)
from ._images import DEFAULT_MAX_IMAGE_PIXELS, check_image

if TYPE_CHECKING:
    from tinsmith.api.limits import RequestLimits

__all__ = [
    "decode_forward_backward_json",
    "decode_forward_backward_protobuf",
    "encode_forward_backward_output_json",
    "encode_forward_backward_output_protobuf",
]

# Wire dtype -> (name, little-endian numpy dtype of the raw bytes, integer?)
_PB_DTYPES: dict[int, tuple[str, np.dtype, bool]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4"), False),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8"), True),
    pb.DTYPE_INT32: ("int32", np.dtype("<i4"), True),
    pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2"), False),
}
_JSON_DTYPES: dict[str, bool] = {"float32": False, "int64": True, "int32": True, "bfloat16": False}


# ---------------------------------------------------------------------------------------------
# Protobuf request


def _pb_array(raw: bytes, wire: np.dtype, name: str, where: str) -> np.ndarray:
    if len(raw) % wire.itemsize:
        fail(f"{where} has {len(raw)} bytes, not a whole number of {name} values")
    return np.frombuffer(raw, dtype=wire)


def _pb_widen(raw: np.ndarray, dtype_name: str) -> np.ndarray:
    """Raw wire values -> float32 or int64, as a fresh writable array."""
    if dtype_name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype_name == "float32":
        return raw.astype(np.float32)
    return raw.astype(np.int64)


def _pb_tensor(t: Any, where: str, key: str, n_tokens: int | None, budget: DenseBudget) -> np.ndarray:
    spec = _PB_DTYPES.get(t.dtype)
    if spec is None:
        fail(f"{where} has unknown dtype {t.dtype} (expected FLOAT32, INT64, INT32 or BFLOAT16)")
    name, wire, integer = spec
    if key == "target_tokens" and not integer:
        fail(f"{where} must be an integer tensor (int64), got {name}")
    shape = [int(d) for d in t.shape]
    if any(d < 0 for d in shape):
        fail(f"{where}.shape {shape} has a negative dimension")
    encoding = t.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = t.sparse_csr
        values = _pb_array(csr.values, wire, name, f"{where}.sparse_csr.values")
        i64 = np.dtype("<i8")
        crow = _pb_array(csr.crow_indices, i64, "int64", f"{where}.sparse_csr.crow_indices")
        col = _pb_array(csr.col_indices, i64, "int64", f"{where}.sparse_csr.col_indices")
        return densify(
            where=where,
            values=_pb_widen(values, name),
            shape=shape,
            crow=crow.astype(np.int64),
            col=col.astype(np.int64),
            expected_rows=n_tokens,
            budget=budget,
        )
    raw = t.dense  # also the empty tensor when no encoding is set
    if shape:
        need = math.prod(shape) * wire.itemsize
        if len(raw) != need:
            fail(
                f"{where} has {len(raw)} bytes of {name} data but its shape {shape} needs {need}"
            )
    values = _pb_array(raw, wire, name, where)
    return densify(
        where=where, values=_pb_widen(values, name), shape=shape, crow=None, col=None,
        expected_rows=n_tokens,
    )


def _pb_spans(spans: Any, where: str) -> list[ProvenanceSpan]:
    out = []
    for k, span in enumerate(spans):
        swhere = f"{where}[{k}]"
        arm = span.WhichOneof("span")
        if arm is None:
            fail(f"{swhere} is neither a prompt_tokens nor a sampled_tokens span")
        body = getattr(span, arm)
        kind = "prompt" if arm == "prompt_tokens" else "sampled"
        out.append(make_span(swhere, kind, body.sequence_id, int(body.offset), int(body.length)))
    return out


def _pb_datum(d: Any, i: int, reads: frozenset[str] | None, budget: DenseBudget, custom: bool,
              max_image_pixels: int) -> Datum:
    """One datum; ``custom``: a custom loss's inputs, whose rows need not match the tokens."""
    where = f"data[{i}]"
    parts: list[np.ndarray] = []
    images: list[ImageInput] = []
    n_text = 0
    for j, chunk in enumerate(d.model_input):
        cwhere = f"{where}.model_input[{j}]"
        arm = chunk.WhichOneof("chunk")
        if arm == "encoded_text":
            raw = _pb_array(chunk.encoded_text.tokens, np.dtype("<i4"), "int32", f"{cwhere}.tokens")
            parts.append(raw.astype(np.int64))
            n_text += raw.size
        elif arm == "image":
            image = chunk.image
            if image.HasField("override_dimensions"):
                fail(f"{cwhere}.override_dimensions is not supported; send the image at the size to use")
            expected = int(image.expected_tokens) if image.HasField("expected_tokens") else None
            images.append(check_image(image.data, image.format, expected, position=n_text, where=cwhere,
                                      max_pixels=max_image_pixels))
        elif arm is None:
            fail(f"{cwhere} is an empty chunk")
        else:
            unsupported_chunk(cwhere, arm)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size == 0 and not images:
        fail(f"{where}.model_input has no tokens")
    check_token_ids(tokens, f"{where}.model_input")
    n = rows_known(tokens, images)

    inputs: dict[str, np.ndarray] = {}
    for key in d.loss_fn_inputs:
        check_text(key, f"{where}.loss_fn_inputs key {key!r}")
        if reads is None or key in reads:
            rows = n if key == "target_tokens" or not custom else None
            inputs[key] = _pb_tensor(d.loss_fn_inputs[key], f"{where}.loss_fn_inputs[{key!r}]", key, rows, budget)
    mi_spans = _pb_spans(d.model_input_spans, f"{where}.model_input_spans")
    lf_spans = _pb_spans(d.loss_fn_input_spans, f"{where}.loss_fn_input_spans")
    if n is not None:
        check_spans(f"{where}.model_input_spans", mi_spans, n, "model_input")
        check_spans(f"{where}.loss_fn_input_spans", lf_spans, n, "loss_fn_inputs (rows)")
    return Datum(tokens=tokens, loss_inputs=inputs, model_input_spans=mi_spans,
                 loss_input_spans=lf_spans, images=images)


def rows_known(tokens: np.ndarray, images: list[ImageInput]) -> int | None:
    """A datum's length in tokens, if known before the model's processor counts its images: the
    text tokens plus every image's ``expected_tokens`` (``None`` when one image has none)."""
    if any(im.expected_tokens is None for im in images):
        return None
    return int(tokens.size) + sum(int(im.expected_tokens or 0) for im in images)


def _pb_token_count(msg: Any) -> int:
    """model_input tokens of every datum, counted from the wire without decoding any."""
    return sum(len(c.encoded_text.tokens) // 4 for d in msg.data for c in d.model_input)


def decode_forward_backward_protobuf(
    body: bytes, *, limits: RequestLimits | None = None
) -> tuple[str, int, ForwardBackwardInput]:
    """Decode the body of ``POST /api/v1/forward_backward`` sent as protobuf.

    Returns ``(model_id, seq_id, input)``. Loss names and required loss inputs are not checked
    here (the loss module does that); shapes, dtypes and alignment with the tokens are, and
    the request's size against ``limits`` before any datum is decoded.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        fail(f"body is not a valid ForwardBackwardRequest protobuf message: {e}")
    if not msg.model_id:
        fail("model_id is empty")
    check_text(msg.model_id, "model_id")
    check_text(msg.loss_fn, "loss_fn")
    if msg.seq_id < 0:
        fail(f"seq_id must be >= 0, got {msg.seq_id}")
    if len(msg.data) == 0:
        fail("data is empty: forward_backward needs at least one datum")
    if limits is not None:
        limits.check_forward_datums(len(msg.data))
        limits.check_forward_tokens(_pb_token_count(msg))

    config: dict[str, LossConfigValue] = {}
    for key, number in msg.loss_fn_config.items():
        config[check_text(key, f"loss_fn_config key {key!r}")] = float(number)
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins where both are present
        check_text(key, f"loss_fn_config_v2 key {key!r}")
        arm = value.WhichOneof("value")
        if arm == "number":
            config[key] = float(value.number)
        elif arm == "text":
            config[key] = check_text(value.text, f"loss_fn_config_v2[{key!r}]")
        else:
            fail(f"loss_fn_config_v2[{key!r}] has neither a number nor a text value")

    reads = inputs_read_by(msg.loss_fn)
    budget = DenseBudget() if limits is None else DenseBudget(limits.dense_elements)
    custom = msg.loss_fn == "custom"
    pixels = DEFAULT_MAX_IMAGE_PIXELS if limits is None else limits.image_pixels
    data = [_pb_datum(d, i, reads, budget, custom, pixels) for i, d in enumerate(msg.data)]
    return (
        msg.model_id,
        int(msg.seq_id),
        ForwardBackwardInput(
            data=data, loss_fn=msg.loss_fn, loss_fn_config=config,
            forward_only=bool(msg.forward_only),
        ),
    )


# ---------------------------------------------------------------------------------------------
# JSON request (SDK <= 0.22.2)


def _json_tensor(obj: Any, where: str, key: str, n_tokens: int | None, budget: DenseBudget) -> np.ndarray:
    if not isinstance(obj, dict):
        fail(f"{where} must be a TensorData object with 'data' and 'dtype'")
    dtype = obj.get("dtype")
    if not isinstance(dtype, str) or dtype not in _JSON_DTYPES:
        fail(f"{where} has unknown dtype {dtype!r} (expected 'int64' or 'float32')")
    integer = _JSON_DTYPES[dtype]
    if key == "target_tokens" and not integer:
        fail(f"{where} must be an integer tensor (int64), got {dtype}")
    if integer:
        values = json_int_array(obj.get("data"), f"{where}.data")
    else:
        values = json_float_array(obj.get("data"), f"{where}.data")

    shape = obj.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(is_int(d) for d in shape):
            fail(f"{where}.shape must be a list of integers")
    crow_raw = obj.get("sparse_crow_indices")
    col_raw = obj.get("sparse_col_indices")
    crow = None if crow_raw is None else json_int_array(crow_raw, f"{where}.sparse_crow_indices")
    col = None if col_raw is None else json_int_array(col_raw, f"{where}.sparse_col_indices")
    return densify(where=where, values=values, shape=shape, crow=crow, col=col,
                   expected_rows=n_tokens, budget=budget)


def _json_datum(obj: Any, i: int, reads: frozenset[str] | None, budget: DenseBudget, custom: bool,
                max_image_pixels: int) -> Datum:
    where = f"data[{i}]"
    if not isinstance(obj, dict):
        fail(f"{where} must be an object with 'model_input' and 'loss_fn_inputs'")
    tokens, images = json_model_input(obj.get("model_input"), f"{where}.model_input", max_image_pixels)
    if tokens.size == 0 and not images:
        fail(f"{where}.model_input has no tokens")
    n = rows_known(tokens, images)
    raw_inputs = obj.get("loss_fn_inputs", {})
    if raw_inputs is None:
        raw_inputs = {}
    if not isinstance(raw_inputs, dict):
        fail(f"{where}.loss_fn_inputs must be an object")
    inputs = {
        str(key): _json_tensor(value, f"{where}.loss_fn_inputs[{key!r}]", key,
                               n if key == "target_tokens" or not custom else None, budget)
        for key, value in raw_inputs.items()
        if reads is None or key in reads
    }
    return Datum(tokens=tokens, loss_inputs=inputs, images=images)


def _json_token_count(raw_data: list) -> int:
    """model_input tokens of every datum, counted before any is decoded (a malformed part counts
    nothing here; decoding it names the mistake)."""
    total = 0
    for d in raw_data:
        model_input = d.get("model_input") if isinstance(d, dict) else None
        chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
        for chunk in chunks if isinstance(chunks, list) else ():
            tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
            total += len(tokens) if isinstance(tokens, list) else 0
    return total


def decode_forward_backward_json(
    obj: dict, *, limits: RequestLimits | None = None
) -> tuple[str, int, ForwardBackwardInput]:
    """Decode a JSON forward/backward body of SDK <= 0.22.2.

    Accepts both ``/api/v1/forward_backward`` bodies (``forward_backward_input``) and
    ``/api/v1/forward`` bodies (``forward_input``, which sets ``forward_only``). Returns
    ``(model_id, seq_id, input)``. The request's size is checked against ``limits`` before any
    datum is decoded.
    """
    if not isinstance(obj, dict):
        fail("forward_backward body must be a JSON object")
    if "forward_backward_input" in obj and "forward_input" in obj:
        fail("body has both forward_backward_input and forward_input")
    if "forward_backward_input" in obj:
        inp, forward_only, name = obj["forward_backward_input"], False, "forward_backward_input"
    elif "forward_input" in obj:
        inp, forward_only, name = obj["forward_input"], True, "forward_input"
    else:
        fail("forward_backward_input is missing")

    model_id = obj.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        fail("model_id is missing or empty")
    seq_id = obj.get("seq_id")
    if not is_int(seq_id):
        fail(f"seq_id must be an integer, got {seq_id!r}")
    if seq_id < 0:
        fail(f"seq_id must be >= 0, got {seq_id}")
    check_int64(seq_id, "seq_id")

    if not isinstance(inp, dict):
        fail(f"{name} must be an object")
    loss_fn = inp.get("loss_fn")
    if not isinstance(loss_fn, str):
        fail(f"{name}.loss_fn must be a string")
    raw_config = inp.get("loss_fn_config")
    config: dict[str, LossConfigValue] = {}
    if raw_config is not None:
        if not isinstance(raw_config, dict):
            fail(f"{name}.loss_fn_config must be an object")
        for key, value in raw_config.items():
            if is_number(value):
                config[str(key)] = float(value)
            elif isinstance(value, str):
                config[str(key)] = value
            else:
                fail(f"{name}.loss_fn_config[{key!r}] must be a number or a string")
    raw_data = inp.get("data")
    if not isinstance(raw_data, list):
        fail(f"{name}.data must be a list")
    if not raw_data:
        fail("data is empty: forward_backward needs at least one datum")
    if limits is not None:
        limits.check_forward_datums(len(raw_data))
        limits.check_forward_tokens(_json_token_count(raw_data))
    reads = inputs_read_by(loss_fn)
    budget = DenseBudget() if limits is None else DenseBudget(limits.dense_elements)
    pixels = DEFAULT_MAX_IMAGE_PIXELS if limits is None else limits.image_pixels
    data = [_json_datum(d, i, reads, budget, loss_fn == "custom", pixels) for i, d in enumerate(raw_data)]
    return model_id, seq_id, ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config, forward_only=forward_only
    )


# ---------------------------------------------------------------------------------------------
# Results


def _output_arrays(result: ForwardBackwardResult) -> list[dict[str, np.ndarray]]:
    """Per-datum outputs as float32/int64 arrays with at least one dimension."""
    outs: list[dict[str, np.ndarray]] = []
    names: list[str] | None = None
    for i, out in enumerate(result.outputs):
        if names is None:
            names = list(out)
        elif set(out) != set(names):
            raise ValueError(
                f"output {i} has fields {sorted(out)} but output 0 has {sorted(names)}; every "
                "datum of one result must have the same output fields"
            )
        conv: dict[str, np.ndarray] = {}
        for name in names:
            a = np.asarray(out[name])
            if a.dtype.kind == "f":
                a = a.astype("<f4", copy=False)
            elif a.dtype.kind in "iub":
                a = a.astype("<i8", copy=False)
            else:
                raise ValueError(f"output {i}[{name!r}] has unsupported dtype {a.dtype}")
            if a.ndim == 0:
                a = a.reshape(1)
            conv[name] = a
        outs.append(conv)
    return outs


def encode_forward_backward_output_protobuf(result: ForwardBackwardResult) -> bytes:
    """Serialize a result as the protobuf ``ForwardBackwardOutput`` the SDK decodes.

    Datums go into one ``ArrayRecord`` with per-field ``BatchedTensor``s (data concatenated,
    int64 byte offsets, ``trailing_shape`` = dims after the per-token one). Consecutive runs of
    datums whose fields differ in trailing shape or dtype, e.g. ``(N,)`` next to ``(N, K)``
    targets, go into separate records, which SDK 0.38.0 concatenates (0.22.2 does not read
    those correctly; serve it JSON).
    """
    check_metric_keys(result.metrics)
    outs = _output_arrays(result)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        msg.metrics[key] = float(value)

    def layout(o: dict[str, np.ndarray]) -> tuple:
        return tuple((n, a.dtype.str, a.shape[1:]) for n, a in o.items())

    start = 0
    while start < len(outs):
        end = start + 1
        while end < len(outs) and layout(outs[end]) == layout(outs[start]):
            end += 1
        group = outs[start:end]
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name, first in group[0].items():
            arrays = [o[name] for o in group]
            offsets = np.zeros(len(arrays) + 1, dtype="<i8")
            np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
            bt = record.fields[name]
            bt.data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32 if first.dtype.kind == "f" else pb.DTYPE_INT64
            bt.trailing_shape.extend(int(d) for d in first.shape[1:])
        start = end
    return msg.SerializeToString()


def encode_forward_backward_output_json(result: ForwardBackwardResult) -> dict:
    """The JSON ``ForwardBackwardOutput`` of SDK <= 0.22.2.

    ``{"loss_fn_output_type", "loss_fn_outputs": [{name: TensorData}], "metrics"}``. The result
    is strict JSON: non-finite floats are written as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (the SDK parses with orjson, which rejects bare NaN, and its pydantic
    models accept these strings as floats).
    """
    check_metric_keys(result.metrics)
    outputs = []
    for out in _output_arrays(result):
        record = {}
        for name, a in out.items():
            if a.dtype.kind == "f":
                record[name] = {"data": json_float_list(a), "dtype": "float32",
                                "shape": list(a.shape)}
            else:
                record[name] = {"data": a.ravel().tolist(), "dtype": "int64",
                                "shape": list(a.shape)}
        outputs.append(record)
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": outputs,
        "metrics": {k: json_float(v) for k, v in result.metrics.items()},
    }
