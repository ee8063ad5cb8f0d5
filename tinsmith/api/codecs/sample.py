"""asample: request decoding (JSON, both SDK generations) and result encoding.

Both ``tinker`` 0.38.0 and 0.22.2 post ``POST /api/v1/asample`` as JSON with
``sampling_session_id`` + ``seq_id`` (neither sends ``base_model``/``model_path``, which the
schema still allows). 0.22.2 sends only ``num_samples``, ``prompt``, ``sampling_params``,
``sampling_session_id``, ``seq_id``, ``prompt_logprobs``, ``topk_prompt_logprobs`` and
``type``; 0.38.0 adds ``topk_sample_logprobs``, ``target_prompt_logprobs``,
``prompt_alt_tokens_k``, ``prompt_logprobs_last_n`` and ``record_stability_info``.
0.38.0 accepts the result only as protobuf; 0.22.2 accepts JSON or protobuf.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from tinker.proto import tinker_public_pb2 as pb
from tinsmith.types import SampledSequence, SampleInput, SampleResult, SamplingParams

from ._common import (
    INT64_MIN,
    TOPK_SENTINEL_LOGPROB,
    TOPK_SENTINEL_TOKEN,
    DenseBudget,
    check_int64,
    csr_row_ids,
    densify,
    fail,
    is_int,
    is_number,
    json_float_list,
    json_int_array,
    json_model_input,
)
from ._images import DEFAULT_MAX_IMAGE_PIXELS

if TYPE_CHECKING:
    from tinsmith.api.limits import RequestLimits

__all__ = [
    "decode_sample_request_json",
    "encode_sample_response_json",
    "encode_sample_response_protobuf",
]

_UINT64_MAX = (1 << 64) - 1
_INT32_MAX = (1 << 31) - 1


# ---------------------------------------------------------------------------------------------
# Request


def _opt_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        fail(f"{key} must be a string")
    return value or None


def _int_field(obj: dict, key: str, default: int | None, where: str, *, wide: bool = False) -> int | None:
    """An optional integer; within int64 (what the database and numpy hold) unless ``wide``."""
    value = obj.get(key)
    if value is None:
        return default
    if not is_int(value):
        fail(f"{where} must be an integer, got {value!r}")
    return value if wide else check_int64(value, where)


def _float_field(obj: dict, key: str, default: float, where: str) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if not is_number(value) or not math.isfinite(value):
        fail(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _bool_field(obj: dict, key: str) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        fail(f"{key} must be true or false, got {value!r}")
    return value


def _stop(value: Any) -> list[str] | list[int] | None:
    where = "sampling_params.stop"
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        fail(f"{where} must be a string, a list of strings or a list of token ids")
    if all(isinstance(v, str) for v in value):
        for k, v in enumerate(value):
            if not v:
                fail(f"{where}[{k}] is an empty string")
        return list(value)
    if all(is_int(v) for v in value):
        for k, v in enumerate(value):
            if v < 0:
                fail(f"{where}[{k}] is a negative token id ({v})")
        return list(value)
    if all(isinstance(v, str) or is_int(v) for v in value):
        fail(f"{where} mixes strings and token ids; use one kind")
    fail(f"{where} must contain only strings or only integer token ids")


def _sampling_params(obj: Any) -> SamplingParams:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        fail("sampling_params must be an object")
    p = "sampling_params"
    max_tokens = _int_field(obj, "max_tokens", None, f"{p}.max_tokens")
    if max_tokens is not None and max_tokens <= 0:
        fail(f"{p}.max_tokens must be > 0, got {max_tokens}")
    temperature = _float_field(obj, "temperature", 1.0, f"{p}.temperature")
    if temperature < 0:
        fail(f"{p}.temperature must be >= 0, got {temperature}")
    top_p = _float_field(obj, "top_p", 1.0, f"{p}.top_p")
    if not 0.0 < top_p <= 1.0:
        fail(f"{p}.top_p must be in (0, 1], got {top_p}")
    top_k = _int_field(obj, "top_k", -1, f"{p}.top_k")
    assert top_k is not None
    if top_k == 0 or top_k < -1:
        fail(f"{p}.top_k must be -1 (no limit) or >= 1, got {top_k}")
    seed = _int_field(obj, "seed", None, f"{p}.seed", wide=True)
    if seed is not None and not INT64_MIN <= seed <= _UINT64_MAX:
        fail(f"{p}.seed must fit in 64 bits, got {seed}")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=_stop(obj.get("stop")),
    )


def decode_sample_request_json(
    obj: dict, *, limits: RequestLimits | None = None
) -> tuple[str | None, int | None, str | None, str | None, SampleInput]:
    """Decode the JSON body of ``POST /api/v1/asample``.

    Returns ``(sampling_session_id, seq_id, base_model, model_path, input)``. At least one of
    ``sampling_session_id``, ``base_model``, ``model_path`` is present, and ``seq_id`` is present
    with ``sampling_session_id`` (the server deduplicates replays on that pair). Sizes are not
    checked against the model or the server's limits here (the route does that, knowing the
    model); ``limits`` only bounds what sparse ``target_prompt_logprobs`` may expand to.
    """
    if not isinstance(obj, dict):
        fail("asample body must be a JSON object")
    sampling_session_id = _opt_str(obj, "sampling_session_id")
    base_model = _opt_str(obj, "base_model")
    model_path = _opt_str(obj, "model_path")
    seq_id = _int_field(obj, "seq_id", None, "seq_id")
    if sampling_session_id is None and base_model is None and model_path is None:
        fail("one of sampling_session_id, base_model or model_path is required")
    if sampling_session_id is not None and seq_id is None:
        fail("seq_id is required with sampling_session_id")
    if seq_id is not None and seq_id < 0:
        fail(f"seq_id must be >= 0, got {seq_id}")

    num_samples = _int_field(obj, "num_samples", 1, "num_samples")
    assert num_samples is not None
    if num_samples < 1:
        fail(f"num_samples must be >= 1, got {num_samples}")

    if "prompt" not in obj:
        fail("prompt is missing")
    pixels = DEFAULT_MAX_IMAGE_PIXELS if limits is None else limits.image_pixels
    prompt, images = json_model_input(obj["prompt"], "prompt", pixels)
    if prompt.size == 0 and not images:
        fail("prompt has no tokens")

    if images:
        for key in ("prompt_logprobs_last_n", "target_prompt_logprobs"):
            if obj.get(key) is not None:
                fail(f"{key} is not supported for a prompt with image chunks (its length in tokens "
                     "is the model's processor's); ask for prompt_logprobs instead")
        if obj.get("prompt_alt_tokens_k"):
            fail("prompt_alt_tokens_k is not supported for a prompt with image chunks; ask for "
                 "prompt_logprobs instead")
    params = _sampling_params(obj.get("sampling_params"))

    prompt_logprobs = _bool_field(obj, "prompt_logprobs")
    record_stability_info = _bool_field(obj, "record_stability_info")
    topk_prompt = _int_field(obj, "topk_prompt_logprobs", 0, "topk_prompt_logprobs")
    topk_sample = _int_field(obj, "topk_sample_logprobs", 0, "topk_sample_logprobs")
    assert topk_prompt is not None and topk_sample is not None
    if topk_prompt < 0:
        fail(f"topk_prompt_logprobs must be >= 0, got {topk_prompt}")
    if topk_sample < 0:
        fail(f"topk_sample_logprobs must be >= 0, got {topk_sample}")

    last_n = _int_field(obj, "prompt_logprobs_last_n", None, "prompt_logprobs_last_n")
    if last_n is not None:
        if not prompt_logprobs:
            fail("prompt_logprobs_last_n requires prompt_logprobs: true")
        if not 1 <= last_n <= prompt.size - 1:
            fail(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = "
                f"{prompt.size - 1}, got {last_n}"
            )

    budget = DenseBudget() if limits is None else DenseBudget(limits.dense_elements)
    targets = _target_prompt_ids(obj.get("target_prompt_logprobs"), int(prompt.size), budget)
    alt_k = _int_field(obj, "prompt_alt_tokens_k", 0, "prompt_alt_tokens_k")
    assert alt_k is not None
    if alt_k < 0:
        fail(f"prompt_alt_tokens_k must be >= 0, got {alt_k}")
    if alt_k > 0 and prompt.size < 2:
        fail("prompt_alt_tokens_k needs a prompt of at least 2 tokens (position 0 has no context)")

    return (
        sampling_session_id,
        seq_id,
        base_model,
        model_path,
        SampleInput(
            prompt=prompt,
            num_samples=num_samples,
            params=params,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt,
            topk_sample_logprobs=topk_sample,
            prompt_logprobs_last_n=last_n,
            record_stability_info=record_stability_info,
            target_prompt_ids=None if targets is None else targets[0],
            target_prompt_csr=None if targets is None else targets[1],
            prompt_alt_tokens_k=alt_k,
            prompt_images=images,
        ),
    )


def _target_prompt_ids(obj: Any, prompt_len: int, budget: DenseBudget) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None] | None:
    """``target_prompt_logprobs`` as dense int64 ids ``(P-1, K)`` (-1 = none) and its CSR layout."""
    where = "target_prompt_logprobs"
    if obj is None:
        return None
    if not isinstance(obj, dict):
        fail(f"{where} must be a TensorData object with 'data', 'dtype' and 'shape'")
    if obj.get("dtype") not in ("int64", "int32"):
        fail(f"{where} must hold int64 token ids, got dtype {obj.get('dtype')!r}")
    if prompt_len < 2:
        fail(f"{where} needs a prompt of at least 2 tokens (position 0 has no context)")
    values = json_int_array(obj.get("data"), f"{where}.data")
    shape = obj.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(is_int(d) for d in shape):
        fail(f"{where}.shape must be [len(prompt) - 1, K] = [{prompt_len - 1}, K], got {shape!r}")
    crow_raw, col_raw = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    crow = None if crow_raw is None else json_int_array(crow_raw, f"{where}.sparse_crow_indices")
    col = None if col_raw is None else json_int_array(col_raw, f"{where}.sparse_col_indices")
    ids = densify(where=where, values=values.astype(np.int64), shape=shape, crow=crow, col=col,
                  expected_rows=prompt_len - 1, pad=-1, rows_of="len(prompt) - 1 = {n}", budget=budget)
    if ids.size and int(ids.min()) < -1:
        fail(f"{where} holds ids below -1 (-1 means no request)")
    if not (ids >= 0).any():
        fail(f"{where} names no token id (every cell is -1)")
    return ids, (None if crow is None else (crow.astype(np.int64), col.astype(np.int64)))  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# Result


def _i32(a: Any, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise ValueError(f"{what} has token ids outside [0, 2^31)")
    return arr.astype("<i4")


def _topk(
    token_ids: Any, logprobs: Any, rows: int, what: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Validated (rows, k) matrices with absent entries set to the SDK's sentinel.

    An entry is absent when its logprob is NaN or -inf (or already the sentinel). Returns None
    when there is nothing to send (k == 0 or no rows), which the SDK reads as None.
    """
    if token_ids is None or logprobs is None:
        return None
    ids = np.asarray(token_ids)
    lps = np.asarray(logprobs, dtype=np.float32)
    if ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError(f"{what}: token ids {ids.shape} and logprobs {lps.shape} must be (n, k)")
    if ids.shape[0] != rows:
        raise ValueError(f"{what} has {ids.shape[0]} rows, expected {rows}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return None
    absent = ~np.isfinite(lps)
    ids = np.where(absent, TOPK_SENTINEL_TOKEN, ids)
    lps = np.where(absent, np.float32(TOPK_SENTINEL_LOGPROB), lps)
    return _i32(ids, what), lps.astype("<f4")


def _sequence_parts(seq: SampledSequence, i: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = _i32(seq.tokens, f"sequences[{i}].tokens").ravel()
    if seq.logprobs is None:
        raise ValueError(f"sequences[{i}].logprobs is missing")
    logprobs = np.asarray(seq.logprobs, dtype="<f4").ravel()
    if logprobs.size != tokens.size:
        raise ValueError(
            f"sequences[{i}] has {tokens.size} tokens but {logprobs.size} logprobs"
        )
    if seq.stop_reason not in ("stop", "length"):
        raise ValueError(f"sequences[{i}].stop_reason {seq.stop_reason!r} is not stop/length")
    return tokens, logprobs


def _prompt_rows(result: SampleResult) -> int:
    if result.prompt_logprobs is not None:
        return int(np.asarray(result.prompt_logprobs).size)
    if result.topk_prompt_token_ids is not None:
        return int(np.asarray(result.topk_prompt_token_ids).shape[0])
    return 0


def encode_sample_response_protobuf(result: SampleResult) -> bytes:
    """Serialize a sampling result as the protobuf ``SampleResponse`` the SDK decodes.

    Sequences keep their order (the SDK pairs them with the submitted sequence ids). Logprobs
    are always sent. ``prompt_logprobs`` keeps NaN where nothing was computed (the SDK turns NaN
    into None); top-k matrices carry the sentinel (0, -99999.0) for absent entries.
    """
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(result.prompt_cache_hit_tokens))
    for i, seq in enumerate(result.sequences):
        tokens, logprobs = _sequence_parts(seq, i)
        s = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=tokens.tobytes(),
            logprobs=logprobs.tobytes(),
        )
        topk = _topk(seq.topk_token_ids, seq.topk_logprobs, tokens.size, f"sequences[{i}].topk")
        if topk is not None:
            ids, lps = topk
            s.topk_sampled_logprobs.token_ids = ids.tobytes()
            s.topk_sampled_logprobs.logprobs = lps.tobytes()
            s.topk_sampled_logprobs.k = ids.shape[1]
            s.topk_sampled_logprobs.length = ids.shape[0]
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype="<f4").ravel().tobytes()
    topk = _topk(result.topk_prompt_token_ids, result.topk_prompt_logprobs, _prompt_rows(result),
                 "topk_prompt_logprobs")
    if topk is not None:
        ids, lps = topk
        msg.topk_prompt_logprobs.token_ids = ids.tobytes()
        msg.topk_prompt_logprobs.logprobs = lps.tobytes()
        msg.topk_prompt_logprobs.k = ids.shape[1]
        msg.topk_prompt_logprobs.length = ids.shape[0]
    if result.target_prompt_logprobs is not None:
        _fill_tensor(msg.target_prompt_logprobs, np.asarray(result.target_prompt_logprobs, dtype="<f4"),
                     pb.DTYPE_FLOAT32, result.target_prompt_csr)
    if result.prompt_alt_tokens is not None and result.prompt_alt_logprobs is not None:
        _fill_tensor(msg.prompt_alt_tokens.tokens, np.asarray(result.prompt_alt_tokens, dtype="<i8"),
                     pb.DTYPE_INT64, None)
        _fill_tensor(msg.prompt_alt_tokens.logprobs, np.asarray(result.prompt_alt_logprobs, dtype="<f4"),
                     pb.DTYPE_FLOAT32, None)
    return msg.SerializeToString()


def _fill_tensor(t: Any, dense: np.ndarray, dtype: int, csr: tuple[np.ndarray, np.ndarray] | None) -> None:
    """A protobuf ``Tensor``: dense, or sparse CSR in the layout the request used.

    Only FLOAT32 and INT64 are sent: the SDK mis-decodes a plain ``Tensor`` in BF16.
    """
    t.dtype = dtype
    t.shape.extend(int(d) for d in dense.shape)
    if csr is None:
        t.dense = np.ascontiguousarray(dense).tobytes()
        return
    crow, col = csr
    t.sparse_csr.values = np.ascontiguousarray(dense[csr_row_ids(crow), col]).tobytes()
    t.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.asarray(col, dtype="<i8").tobytes()


def encode_sample_response_json(result: SampleResult) -> dict:
    """The JSON ``SampleResponse`` of SDK <= 0.22.2.

    ``{"type": "sample", "sequences": [{"stop_reason", "tokens", "logprobs"}],
    "prompt_logprobs"?: [float | None], "topk_prompt_logprobs"?: [None | [[token, logprob]...]]}``
    Strict JSON: NaN prompt logprobs become null, other non-finite floats the strings
    ``"Infinity"``/``"-Infinity"``/``"NaN"``.
    """
    sequences = []
    for i, seq in enumerate(result.sequences):
        tokens, logprobs = _sequence_parts(seq, i)
        sequences.append({
            "stop_reason": seq.stop_reason,
            "tokens": tokens.tolist(),
            "logprobs": json_float_list(logprobs),
        })
    out: dict[str, Any] = {"type": "sample", "sequences": sequences}
    if result.prompt_logprobs is not None:
        out["prompt_logprobs"] = json_float_list(
            np.asarray(result.prompt_logprobs, dtype=np.float32), none_for_nan=True
        )
    topk = _topk(result.topk_prompt_token_ids, result.topk_prompt_logprobs, _prompt_rows(result),
                 "topk_prompt_logprobs")
    if topk is not None:
        ids, lps = topk
        out["topk_prompt_logprobs"] = _topk_rows_json(ids, lps)
    # Newer fields, for JSON clients that ask for them (SDK 0.22.2 cannot): TensorData objects.
    if result.target_prompt_logprobs is not None:
        out["target_prompt_logprobs"] = _json_tensor_data(
            np.asarray(result.target_prompt_logprobs, dtype=np.float32), "float32", result.target_prompt_csr)
    if result.prompt_alt_tokens is not None and result.prompt_alt_logprobs is not None:
        out["prompt_alt_tokens"] = {
            "tokens": _json_tensor_data(np.asarray(result.prompt_alt_tokens, dtype=np.int64), "int64", None),
            "logprobs": _json_tensor_data(np.asarray(result.prompt_alt_logprobs, dtype=np.float32), "float32", None),
        }
    return out


def encode_sample_sequences_json(result: SampleResult) -> dict:
    """The sampled sequences alone, with their top-k logprobs when asked for: what the
    OpenAI-compatible routes read back (not a Tinker wire format; no SDK sees it).

    ``{"sequences": [{"stop_reason", "tokens", "logprobs", "topk_logprobs"?: [[[token, logprob]...]...]}]}``
    """
    sequences = []
    for i, seq in enumerate(result.sequences):
        tokens, logprobs = _sequence_parts(seq, i)
        entry = {"stop_reason": seq.stop_reason, "tokens": tokens.tolist(), "logprobs": json_float_list(logprobs)}
        topk = _topk(seq.topk_token_ids, seq.topk_logprobs, tokens.size, f"sequences[{i}].topk")
        if topk is not None:
            entry["topk_logprobs"] = _topk_rows_json(*topk)
        sequences.append(entry)
    return {"sequences": sequences}


def _topk_rows_json(ids: np.ndarray, lps: np.ndarray) -> list[Any]:
    """Top-k rows as ``[[token, logprob], ...]`` per position; ``None`` where nothing was computed."""
    rows: list[Any] = []
    sentinel_lp = np.float32(TOPK_SENTINEL_LOGPROB)
    for r in range(ids.shape[0]):
        sentinel = (ids[r] == TOPK_SENTINEL_TOKEN) & (lps[r] == sentinel_lp)
        keep = ~sentinel
        if not keep[0]:
            rows.append(None)
            continue
        n = int(np.flatnonzero(keep).max()) + 1  # trailing sentinels are padding
        rows.append([[int(t), float(lp)] for t, lp in zip(ids[r, :n], lps[r, :n])])
    return rows


def _json_tensor_data(dense: np.ndarray, dtype: str, csr: tuple[np.ndarray, np.ndarray] | None) -> dict:
    """The JSON ``TensorData`` form: dense row-major, or CSR values in the request's layout."""
    out: dict[str, Any] = {"dtype": dtype, "shape": [int(d) for d in dense.shape]}
    if csr is None:
        values = dense.ravel()
    else:
        crow, col = csr
        values = dense[csr_row_ids(crow), col]
        out["sparse_crow_indices"] = [int(v) for v in crow]
        out["sparse_col_indices"] = [int(v) for v in col]
    out["data"] = json_float_list(values) if dtype == "float32" else [int(v) for v in values]
    return out
