"""Pieces shared by the wire codecs: array densification and validation, JSON numbers.

Every decoding failure raises :class:`tinsmith.errors.InvalidInputError` with a message that
starts with the offending field's path (``data[3].loss_fn_inputs['weights']``,
``sampling_params.top_p``...), so a user can find the mistake in their own request.
Encoding failures are server bugs and raise ``ValueError``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import numpy as np
import pydantic_core

from tinsmith.errors import InvalidInputError
from tinsmith.types import ImageInput, ProvenanceSpan

# Sparse CSR tensors are densified on arrival; the sparse tensors of one request may create no
# more elements together than a dense body could carry at 4 bytes each (a tiny request must not
# be able to allocate gigabytes). This is the bound for the default --max-body-bytes (256 MiB).
MAX_DENSE_ELEMENTS = 1 << 26

# JSON bodies nested deeper than this are refused: it is the parser's own bound (pydantic-core),
# far below Python's recursion limit, so nothing downstream (validation, storage) can overflow.
MAX_JSON_DEPTH = 200
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# Sentinel the SDK recognises as "no entry" in top-k matrices (token 0, this logprob).
TOPK_SENTINEL_TOKEN = 0
TOPK_SENTINEL_LOGPROB = -99999.0

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_NONFINITE_WORDS = {"nan", "inf", "-inf", "+inf", "infinity", "-infinity", "+infinity"}


def fail(message: str) -> NoReturn:
    raise InvalidInputError(message)


def is_int(value: Any) -> bool:
    """A JSON integer (``bool`` is an ``int`` subclass in Python but not an integer here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int64(value: int, where: str) -> int:
    """An integer the database can hold (BIGINT): anything wider is refused, not overflowed."""
    if not INT64_MIN <= value <= INT64_MAX:
        fail(f"{where} must fit in a signed 64-bit integer, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Text and JSON from the wire


def text_problem(value: str) -> str | None:
    """Why a string cannot be stored or logged as it is, or None when it can.

    A NUL character is refused by PostgreSQL (and cut short by C APIs); a lone surrogate
    (``"\\ud800"`` in JSON) is not Unicode and cannot be encoded as UTF-8 for the database,
    the log or a response.
    """
    if "\x00" in value:
        return "contains a NUL character (\\u0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode)"
    return None


def check_text(value: str, where: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        fail(f"{where} {problem}")
    return value


def find_bad_text(obj: Any) -> tuple[str, str] | None:
    """The first string of parsed JSON (a value or an object key) that ``text_problem`` refuses.

    Returns ``(where, problem)``, ``where`` being the path of the field (``tags[0]``,
    ``user_metadata.note``, or ``user_metadata key 'a\\x00'`` for a key).
    """
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem is not None:
                return path or "body", problem
        elif isinstance(node, dict):
            for key, value in node.items():
                problem = text_problem(key)
                if problem is not None:
                    return f"{path or 'body'} key {key!r}", problem
                stack.append((value, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node) if isinstance(v, (str, dict, list)))
    return None


def parse_json(body: bytes) -> Any:
    """Parse a JSON request body, refusing what could not be stored or would exhaust the stack.

    Refused with a 400: invalid JSON, nesting deeper than ``MAX_JSON_DEPTH``, and strings (values
    or keys) holding a NUL character or a lone surrogate, named by their field.
    """
    try:
        obj = pydantic_core.from_json(body)
    except ValueError as e:
        fail(_json_error(body, str(e)))
    # A NUL reaches a parsed string only through this escape (raw control characters are
    # invalid JSON), so bodies without it, nearly all of them, are not walked at all.
    if b"\\u0000" in body:
        bad = find_bad_text(obj)
        if bad is not None:
            fail(f"invalid request: {bad[0]} {bad[1]}")
    return obj


def _json_error(body: bytes, message: str) -> str:
    if "recursion limit" in message:
        return f"invalid request: body is nested more than {MAX_JSON_DEPTH} levels deep"
    if _SURROGATE_ESCAPE.search(body):
        # The strict parser refuses lone surrogates without naming the field; the standard
        # library's parser keeps them, so the field can be found and named.
        try:
            bad = find_bad_text(json.loads(body))
        except (ValueError, RecursionError):
            bad = None
        if bad is not None:
            return f"invalid request: {bad[0]} {bad[1]}"
    return f"invalid request: body is not valid JSON: {message}"


# ---------------------------------------------------------------------------------------------
# Dense arrays from the wire


class DenseBudget:
    """How many elements the sparse tensors of one request may still expand to."""

    def __init__(self, elements: int = MAX_DENSE_ELEMENTS) -> None:
        self.total = self.left = elements

    def take(self, where: str, shape: list[int]) -> None:
        n = math.prod(shape)
        if n > self.left:
            fail(
                f"{where} has dense shape {shape} ({n} elements); the sparse tensors of one request may "
                f"expand to at most {self.total} elements in all (a quarter of --max-body-bytes)"
            )
        self.left -= n


def densify(
    *,
    where: str,
    values: np.ndarray,
    shape: list[int] | None,
    crow: np.ndarray | None,
    col: np.ndarray | None,
    expected_rows: int | None,
    pad: int | float = 0,
    rows_of: str = "model_input has {n} tokens",
    budget: DenseBudget | None = None,
) -> np.ndarray:
    """Build the dense array a loss input stands for, and check it against the datum.

    ``values`` is 1-D in its final dtype. ``shape`` empty or ``None`` means 1-D. With
    ``crow``/``col`` the tensor is 2-D sparse CSR and unlisted entries are ``pad``; its dense
    size is taken from ``budget`` (the request's, shared by all its tensors) before anything is
    allocated. The leading dimension must equal ``expected_rows`` (``rows_of`` says what that
    is, for the message); ``None`` when it is not known yet: a custom loss's inputs have shapes of
    their own, and a model input with images has token counts only the model's processor knows
    (:func:`check_rows` is called then).
    """
    if shape is not None and len(shape) == 0:
        shape = None
    if shape is not None and any(d < 0 for d in shape):
        fail(f"{where}.shape {shape} has a negative dimension")

    if crow is None:
        if col is not None:
            fail(f"{where} has sparse column indices but no sparse row pointers (crow_indices)")
        if shape is None:
            shape = [int(values.size)]
        n = math.prod(shape)
        if n != values.size:
            fail(f"{where} has {values.size} values but its shape {shape} needs {n}")
        arr = values.reshape(shape)
    else:
        if col is None:
            fail(f"{where} has sparse row pointers (crow_indices) but no column indices")
        if shape is None:
            fail(f"{where} is sparse CSR but has no shape")
        if len(shape) != 2:
            fail(f"{where} is sparse CSR with shape {shape}; only 2-D CSR tensors are supported")
        rows, cols = shape
        if expected_rows is not None and rows != expected_rows:
            fail(f"{where} has {rows} rows but {rows_of.format(n=expected_rows)}")
        (budget or DenseBudget()).take(where, shape)
        nnz = int(values.size)
        if crow.size != rows + 1:
            fail(
                f"{where}: sparse crow_indices has {crow.size} entries but shape {shape} needs "
                f"{rows + 1}"
            )
        counts = np.diff(crow)
        if int(crow[0]) != 0 or int(crow[-1]) != nnz or (counts < 0).any():
            fail(
                f"{where}: sparse crow_indices must start at 0, never decrease and end at the "
                f"number of values ({nnz})"
            )
        if col.size != nnz:
            fail(f"{where}: sparse col_indices has {col.size} entries but there are {nnz} values")
        arr = np.full((rows, cols), pad, dtype=values.dtype)
        if nnz:
            if int(col.min()) < 0 or int(col.max()) >= cols:
                fail(f"{where}: sparse col_indices out of range for {cols} columns")
            row_ids = csr_row_ids(crow)
            flat = row_ids * cols + col
            if np.unique(flat).size != nnz:
                fail(f"{where}: sparse col_indices list the same entry twice")
            arr[row_ids, col] = values

    if expected_rows is not None:
        check_rows(where, arr, expected_rows, rows_of)
    return arr


def check_rows(where: str, arr: np.ndarray, expected_rows: int, rows_of: str = "model_input has {n} tokens") -> None:
    if arr.shape[0] != expected_rows:
        fail(f"{where} has {arr.shape[0]} rows but {rows_of.format(n=expected_rows)}")


def csr_row_ids(crow: np.ndarray) -> np.ndarray:
    """The row of each listed value of a CSR tensor, from its row pointers."""
    return np.repeat(np.arange(len(crow) - 1, dtype=np.int64), np.diff(crow))


def check_spans(where: str, spans: list[ProvenanceSpan], n_positions: int, what: str) -> None:
    """Provenance runs tile the field they annotate: their lengths sum to its length."""
    if not spans:
        return
    total = sum(s.length for s in spans)
    if total != n_positions:
        fail(f"{where} cover {total} positions but {what} has {n_positions}")


def make_span(where: str, kind: str, sequence_id: Any, offset: Any, length: Any) -> ProvenanceSpan:
    if not isinstance(sequence_id, str) or not sequence_id:
        fail(f"{where}.sequence_id must be a non-empty string")
    check_text(sequence_id, f"{where}.sequence_id")
    if not is_int(offset) or offset < 0:
        fail(f"{where}.offset must be an integer >= 0, got {offset!r}")
    if not is_int(length) or length < 0:
        fail(f"{where}.length must be an integer >= 0, got {length!r}")
    return ProvenanceSpan(
        kind=kind, sequence_id=sequence_id, offset=offset, length=length  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------------------------
# JSON numbers in


def json_int_array(value: Any, where: str) -> np.ndarray:
    """A flat JSON list of integers as int64 (integral floats such as ``3.0`` are accepted)."""
    if not isinstance(value, list):
        fail(f"{where} must be a list of integers")
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        fail(f"{where} must be a flat list of integers")
    if arr.ndim != 1:
        fail(f"{where} must be a flat list of integers")
    kind = arr.dtype.kind
    if kind in "iu" and any(x is True or x is False for x in value):
        fail(f"{where} must contain only integers (within int64), found true/false")
    if kind == "i":
        return arr.astype(np.int64, copy=False)
    if kind == "u":
        if int(arr.max()) > INT64_MAX:
            fail(f"{where} has a value outside the int64 range")
        return arr.astype(np.int64)
    if kind == "f":
        if not np.isfinite(arr).all() or (arr != np.round(arr)).any():
            fail(f"{where} must contain integers, found a non-integral number")
        if arr.min() < INT64_MIN or arr.max() > INT64_MAX:
            fail(f"{where} has a value outside the int64 range")
        return arr.astype(np.int64)
    # bools, strings, nulls, nested lists, integers beyond 64 bits
    fail(f"{where} must contain only integers (within int64)")


def json_float_array(value: Any, where: str) -> np.ndarray:
    """A flat JSON list of numbers as float32; ``"NaN"``/``"Infinity"`` strings are accepted."""
    if not isinstance(value, list):
        fail(f"{where} must be a list of numbers")
    if not value:
        return np.zeros(0, dtype=np.float32)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        fail(f"{where} must be a flat list of numbers")
    if arr.ndim != 1:
        fail(f"{where} must be a flat list of numbers")
    if arr.dtype.kind in "iuf":
        return arr.astype(np.float32)
    out = np.empty(len(value), dtype=np.float32)
    for i, x in enumerate(value):
        if is_number(x):
            out[i] = float(x)
        elif isinstance(x, str) and x.strip().lower() in _NONFINITE_WORDS:
            out[i] = float(x.strip().lower().replace("infinity", "inf"))
        else:
            fail(f"{where}[{i}] is not a number: {x!r}")
    return out


# ---------------------------------------------------------------------------------------------
# JSON numbers out (strict JSON: the SDK parses with orjson, which rejects NaN/Infinity;
# pydantic in lax mode accepts these strings for float fields)


def _nonfinite_word(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def json_float(x: float) -> float | str:
    x = float(x)
    return x if math.isfinite(x) else _nonfinite_word(x)


def json_float_list(arr: np.ndarray, none_for_nan: bool = False) -> list[Any]:
    """Flat list of Python floats, exact float32 values; NaN/inf become strings (or None)."""
    a = np.asarray(arr, dtype=np.float64).ravel()
    out: list[Any] = a.tolist()
    bad = ~np.isfinite(a)
    if bad.any():
        for i in np.flatnonzero(bad):
            x = out[i]
            out[i] = None if (none_for_nan and math.isnan(x)) else _nonfinite_word(x)
    return out


def check_metric_keys(metrics: dict[str, float]) -> None:
    for key in metrics:
        if not isinstance(key, str) or key.count(":") != 1:
            raise ValueError(
                f"metric key {key!r} must have the form 'name:reduction' with exactly one ':' "
                "(the SDK's chunk merge fails otherwise)"
            )


# ---------------------------------------------------------------------------------------------
# ModelInput, JSON form: {"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}

_UNSUPPORTED_CHUNKS = {
    "image_asset_pointer": "this server does not fetch images by location; send the image's bytes "
                           "in an ImageChunk instead",
    "dmel": "audio (dmel) input is not supported by this server's models",
}


def unsupported_chunk(where: str, chunk_type: str) -> NoReturn:
    reason = _UNSUPPORTED_CHUNKS.get(chunk_type, "this chunk type is not supported")
    fail(f"{where} is a {chunk_type!r} chunk: {reason}")


def check_token_ids(tokens: np.ndarray, where: str) -> None:
    if tokens.size and int(tokens.min()) < 0:
        fail(f"{where} has a negative token id ({int(tokens.min())})")


def _chunk_type(chunk: dict) -> Any:
    """A JSON chunk's type; a chunk with tokens and no type counts as text."""
    return chunk.get("type", "encoded_text" if "tokens" in chunk else None)


def tokens_only(obj: Any) -> bool:
    """Whether a JSON ModelInput holds text chunks alone (nothing to decode but token ids); False
    for anything else, malformed input included (its decoding says what is wrong)."""
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    return isinstance(chunks, list) and all(isinstance(c, dict) and _chunk_type(c) == "encoded_text" for c in chunks)


def json_model_input(obj: Any, where: str, max_image_pixels: int) -> tuple[np.ndarray, list[ImageInput]]:
    """A JSON ModelInput as int64 text token ids and the checked images that sit between them."""
    from ._images import check_image, json_image_bytes

    if not isinstance(obj, dict):
        fail(f"{where} must be an object with 'chunks'")
    chunks = obj.get("chunks")
    if not isinstance(chunks, list):
        fail(f"{where}.chunks must be a list")
    parts: list[np.ndarray] = []
    images: list[ImageInput] = []
    n_text = 0
    for j, chunk in enumerate(chunks):
        cwhere = f"{where}.chunks[{j}]"
        if not isinstance(chunk, dict):
            fail(f"{cwhere} must be an object")
        ctype = _chunk_type(chunk)
        if ctype == "encoded_text":
            parts.append(json_int_array(chunk.get("tokens"), f"{cwhere}.tokens"))
            n_text += parts[-1].size
        elif ctype == "image":
            images.append(check_image(json_image_bytes(chunk.get("data"), cwhere), chunk.get("format"),
                                      chunk.get("expected_tokens"), position=n_text, where=cwhere,
                                      max_pixels=max_image_pixels))
        elif isinstance(ctype, str):
            unsupported_chunk(cwhere, ctype)
        else:
            fail(f"{cwhere} has no chunk 'type'")
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    check_token_ids(tokens, where)
    return tokens, images
