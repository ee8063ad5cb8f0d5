"""Wire codecs: Tinker request bodies -> ``tinsmith.types``, results -> Tinker response bodies.

Pure functions (no HTTP, no torch, no database). The protobuf messages are the SDK's own
(``tinker.proto.tinker_public_pb2``): the SDK is the contract. Decoders raise
``tinsmith.errors.InvalidInputError`` naming the offending field; encoders raise ``ValueError``
for results that cannot be represented (a server bug).

Which function serves which route:

* ``POST /api/v1/forward_backward`` with ``Content-Type: application/x-protobuf``
  -> :func:`decode_forward_backward_protobuf` (SDK 0.38.0; 0.22.2 with ``proto_write_fwdbwd``)
* ``POST /api/v1/forward_backward`` and ``POST /api/v1/forward`` with JSON
  -> :func:`decode_forward_backward_json` (SDK <= 0.22.2)
* ``POST /api/v1/asample`` -> :func:`decode_sample_request_json` (all SDKs)
* ``retrieve_future`` results for forward/backward and sample: protobuf
  (``Content-Type: application/x-protobuf``) when the poll's ``Accept`` header is
  ``application/x-protobuf`` alone (0.38.0 requires protobuf); JSON when ``Accept`` also lists
  ``application/json`` (0.22.2 sends ``application/x-protobuf, application/json`` and reads
  both, but its protobuf reader mishandles results mixing ``(N,)`` and ``(N, K)`` outputs).
  JSON results must be rendered as strict JSON (the SDK parses with orjson); the JSON encoders
  already write non-finite floats as strings, so ``json.dumps(..., allow_nan=False)`` works.
"""

from ._common import tokens_only
from .forward_backward import (
    decode_forward_backward_json,
    decode_forward_backward_protobuf,
    encode_forward_backward_output_json,
    encode_forward_backward_output_protobuf,
)
from .sample import (
    decode_sample_request_json,
    encode_sample_response_json,
    encode_sample_response_protobuf,
    encode_sample_sequences_json,
)

__all__ = [
    "tokens_only",
    "decode_forward_backward_json",
    "decode_forward_backward_protobuf",
    "decode_sample_request_json",
    "encode_forward_backward_output_json",
    "encode_forward_backward_output_protobuf",
    "encode_sample_response_json",
    "encode_sample_sequences_json",
    "encode_sample_response_protobuf",
]
