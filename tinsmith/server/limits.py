"""Per-API-key limits: how much of the server's shared capacity one key may take.

One server serves many keys at once. Without limits one key could hold every training-run
slot, evict the sampler snapshots other keys are sampling, queue so much work that every other
key waits behind it, or fill the disk. Each limit is enforced where it can be checked exactly:

* **Requests in flight** (``--max-requests-in-flight-per-key``): a transient limit, checked at
  submission (:meth:`KeyLimits.admit`) before the request is stored. The answer is a 429 with
  ``Retry-After``: the SDK backs off and resubmits by itself, and the request goes through as
  soon as some of the key's earlier work has finished.
* **Training runs and sampler snapshots held** (``--max-runs-per-key``,
  ``--max-sampler-snapshots-per-key``, and ``--max-snapshot-host-bytes-per-key`` for the host
  memory that full fine-tunes' snapshots take): the worker alone knows what is held, so it enforces
  them (they travel in ``RuntimeOptions``). Only the key can lift a run cap (by freeing a run),
  so a create over it fails its future at once with a message rather than being retried; a new
  snapshot over its cap first evicts the key's own idle snapshots.
* **Request rate** (``--max-requests-per-second-per-key``, ``--request-burst-per-key``): every HTTP
  request of the key, refused with a 429 before it is routed while another key is being served
  (:mod:`tinsmith.api.request_rates`): polls and reads hold nothing in flight, yet take the
  event loop's time from everyone's work.
* **Checkpoint storage** (``--checkpoint-quota-bytes``): checked before anything is written
  (:meth:`KeyLimits.check_storage`), counting the bytes about to be written, not only those
  already used.

In single-user mode (no ``--api-keys-file``) every caller is the same tenant, so there is no
other key to protect: the per-key caps are off. The storage quota is asked for explicitly and
applies in both modes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from tinsmith.errors import CapacityError, TooManyRequestsError
from tinsmith.tenants import key_id

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # what a 429 asks the client to wait; the SDK's own sampling backoff is 1 s too


class StorageLedger(Protocol):
    def owner_storage_bytes(self, owner: str) -> int: ...


@dataclass(frozen=True)
class KeyLimits:
    """The per-key limits in force (None: no limit)."""

    max_requests_in_flight: int | None = None
    max_runs: int | None = None
    max_sampler_snapshots: int | None = None
    max_snapshot_host_bytes: int | None = None  # host memory of the key's full fine-tunes' sampler snapshots
    checkpoint_quota_bytes: int | None = None
    retry_after_s: float = RETRY_AFTER_S

    @classmethod
    def from_config(cls, config, multi_tenant: bool) -> "KeyLimits":
        """The limits of a server built from ``config`` (a ``ServerConfig``; its ranges are checked
        by the field types, when it is built)."""
        per_key = (lambda v: v) if multi_tenant else (lambda v: None)
        return cls(
            max_requests_in_flight=per_key(config.max_requests_in_flight_per_key),
            max_runs=per_key(config.max_runs_per_key),
            max_sampler_snapshots=per_key(config.max_sampler_snapshots_per_key),
            max_snapshot_host_bytes=per_key(config.max_snapshot_host_bytes_per_key),
            checkpoint_quota_bytes=config.checkpoint_quota_bytes,
        )

    def admit(self, owner: str, in_flight: int) -> None:
        """Refuse a new request while ``owner`` already has the most it may have queued or running."""
        cap = self.max_requests_in_flight
        if cap is not None and in_flight >= cap:
            raise TooManyRequestsError(
                f"this API key already has {in_flight} requests queued or running, the most this server allows "
                f"(--max-requests-in-flight-per-key {cap}); retry once some have finished",
                retry_after_s=self.retry_after_s,
            )

    def check_storage(self, ledger: StorageLedger, owner: str, incoming: int, *, replacing: int = 0,
                      what: str = "this checkpoint") -> None:
        """Refuse to write ``incoming`` bytes for ``owner`` if they would take it past its quota.

        ``replacing``: bytes of the owner's checkpoint that the write replaces (an overwrite),
        which stop counting once it is done.
        """
        quota = self.checkpoint_quota_bytes
        if quota is None:
            return
        used = ledger.owner_storage_bytes(owner)
        if used - replacing + incoming > quota:
            log.warning("refused a checkpoint write of %d bytes to key %s: it uses %d of its %d bytes "
                        "(--checkpoint-quota-bytes)", incoming, key_id(owner), used, quota)
            raise CapacityError(
                f"checkpoint storage quota exceeded: {what} needs {incoming} bytes and this API key already uses "
                f"{used} of its {quota} bytes (--checkpoint-quota-bytes); delete checkpoints first"
            )
