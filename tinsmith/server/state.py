"""Builds and owns the running server's parts: store, worker, engine and authenticator."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinsmith.api.auth import Authenticator
from tinsmith.api.request_rates import RequestRates
from tinsmith.checkpoints.peft_format import recover_interrupted_commits
from tinsmith.custom_losses.cache import CustomLossCache
from tinsmith.engine.scheduler import Engine, Job
from tinsmith.errors import TinsmithError
from tinsmith.server.config import ServerConfig
from tinsmith.server.limits import KeyLimits
from tinsmith.server.logs import log_startup_summary
from tinsmith.server.metrics import ServerMetrics
from tinsmith.server.exclusive import DatabaseLease, DataDirLock
from tinsmith.server.operations import WorkerOperations
from tinsmith.server.private import make_private
from tinsmith.server.throughput import Throughput
from tinsmith.server.usage import UsageMeter
from tinsmith.server.startup import StartupError
from tinsmith.store import LeaseRecord, Store
from tinsmith.worker.service import RuntimeOptions, Worker
from tinsmith.worker.warm_up import warm_up

log = logging.getLogger(__name__)

KEYS_POLL_S = 2.0  # how often the API keys file is checked for changes
SESSION_SWEEP_SLACK_S = 0.05  # wake just past a session's deadline, so it is due when checked
SWEEP_RETRY_S = 5.0  # after a failed sweep (database unreachable), try again this soon


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    worker: Worker
    engine: Engine
    auth: Authenticator
    secret: bytes = b""  # signs download links; kept in the data dir so links survive restarts
    sweep_interval_s: float = 60.0  # checkpoint TTLs and request retention; sessions are swept on time
    limits: KeyLimits = field(default_factory=KeyLimits)
    request_rates: RequestRates = field(default_factory=lambda: RequestRates(per_second=0.0, burst=1))
    metrics: ServerMetrics = field(init=False)
    throughput: Throughput = field(default_factory=Throughput)
    started_at: float = field(default_factory=time.time)
    custom_losses: CustomLossCache = field(default_factory=CustomLossCache)
    usage: UsageMeter | None = None  # per-key token counts, written to the store in batches
    _tasks: list = field(default_factory=list)
    _lock: DataDirLock | None = None
    _lease: DatabaseLease | None = None
    _prepared: bool = False

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self)
        if self.engine is not None:
            self.engine.observers.append(self.metrics.observe_job)

    @classmethod
    def build(cls, config: ServerConfig) -> "ServerState":
        if not config.base_model:
            raise ValueError("no base model: pass --base-model ID_OR_DIR (or TINSMITH_BASE_MODEL)")
        config.validate()  # again: fields may have been assigned since it was built
        auth = Authenticator(config.api_keys_file)
        limits = KeyLimits.from_config(config, auth.multi_tenant)
        store = Store(config.resolved_database_url)
        worker = Worker(
            RuntimeOptions(
                device=config.resolved_device,
                dtype=config.dtype,
                device_memory_fraction=config.device_memory_fraction,
                max_lora_adapters=config.max_lora_adapters,
                max_lora_rank=config.max_lora_rank,
                max_training_runs=config.max_training_runs,
                micro_batch_tokens=config.train_micro_batch_tokens,
                chunk_tokens=config.train_chunk_tokens,
                micro_batch_seqs=config.train_micro_batch_size or (1 << 30),
                gradient_checkpointing=config.gradient_checkpointing,
                packing=config.train_packing,
                max_full_finetunes=config.max_full_finetunes,
                max_full_sampler_snapshots=config.max_full_sampler_snapshots,
                resident_full_sampler_snapshots=config.resident_full_sampler_snapshots,
                max_snapshot_host_bytes=config.max_snapshot_host_bytes,
                max_snapshot_host_bytes_per_key=limits.max_snapshot_host_bytes,
                max_sampler_snapshots=config.max_sampler_snapshots,
                max_runs_per_key=limits.max_runs,
                max_sampler_snapshots_per_key=limits.max_sampler_snapshots,
                sampler_snapshot_idle_s=config.sampler_snapshot_idle_s,
                tensor_parallel_size=config.tensor_parallel_size,
                data_parallel_size=config.data_parallel_size,
                ray_address=config.ray_address,
                ray_placement_strategy=config.ray_placement_strategy,
                max_sampling_rows=(RuntimeOptions.max_sampling_rows if config.max_num_samples is None
                                   else config.max_num_samples),
                prefix_cache_bytes=config.prefix_cache_bytes,
                sampler_kv_cache_bytes=config.sampler_kv_cache_bytes,
                sampler_cuda_graphs=config.sampler_cuda_graphs,
                sampler_run_ahead=config.sampler_run_ahead,
                dependent_launches=config.dependent_launches,
                sampler_kv_cache_layout=config.sampler_kv_cache_layout,
                sampler_prefill_chunk_tokens=config.sampler_prefill_chunk_tokens,
            )
        )
        throughput, usage = Throughput(), UsageMeter(store)
        engine = Engine(WorkerOperations(worker, store, limits, throughput, usage), store,
                        seq_gap_wait_s=config.seq_gap_wait_s)
        return cls(config, store, worker, engine, auth, limits=limits, throughput=throughput, usage=usage,
                   request_rates=RequestRates.from_config(config, auth.multi_tenant))

    def claim(self) -> None:
        """Become the one server of this data dir and database, or raise ``AlreadyServing``.

        Runs before anything is recovered or loaded: a second server must not touch the
        runs of the first (recovery would mark them lost), and should be refused in a moment,
        not after loading models. Also makes the data dir and checkpoints private, reads the
        download secret and migrates the schema (the lease lives in it). Idempotent.
        """
        if self._lock is not None:
            return
        lock = DataDirLock.acquire(self.config.data_dir)
        try:
            make_private(self.config.data_dir, self.config.resolved_checkpoint_dir, self.store.sqlite_path)
            self.secret = _load_secret(self.config.data_dir)
            self.store.migrate()
            self._lease = DatabaseLease.acquire(self.store, self.config.data_dir, on_lost=_stop_after_losing_lease)
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    def release(self) -> None:
        """Give back the database lease and the data dir lock (clean shutdown)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def load_models(self) -> None:
        """Load every base model (blocking; done once at start-up).

        A model that fails to load raises ``StartupError`` naming it, with the cause chained.
        """
        for name in self.config.base_model:
            _load_or_explain(lambda: self.worker.add_base_model(name), name)
        for alias, target in self.config.aliases().items():
            if target in self.worker.bases:
                self.worker.add_alias(alias, target)
            else:
                _load_or_explain(lambda: self.worker.add_base_model(alias, target), target)
        if self.config.warm_up:
            for name, base in self.worker.bases.items():
                _load_or_explain(lambda: log.info("warm-up of %s: sampling and training ran once in %.2f s", name,
                                                  warm_up(self.worker, base)), name)

    def prepare(self) -> None:
        """The slow, blocking part of start-up: claim, recover, load the models. Once only.

        ``tinsmith serve`` calls it before the HTTP server starts, so a failure is reported as
        one line; an embedded server gets it from ``start()``.
        """
        if self._prepared:
            return
        self.claim()
        self.recover_after_restart()
        self.load_models()
        self._prepared = True

    def recover_after_restart(self) -> None:
        """Nothing in memory survived the last process: say so, durably and clearly.

        Runs that were active have lost their unsaved adapter state; requests that were still
        pending or running are failed with a message naming the model, so no client waits on
        a future that can never complete.
        """
        lost = self.store.list_models_by_status("active")
        for m in lost:
            self.store.update_model_status(m.model_id, "lost")
        for r in self.store.list_unfinished_requests():
            target = f" for model {r.model_id!r}" if r.model_id else ""
            self.store.fail_request(
                r.request_id,
                f"the server restarted while this {r.kind} request{target} was in flight; "
                "its in-memory state was lost. Re-create the model or load it from a checkpoint.",
                "server",
            )
        if lost:
            log.info("restart: %d training run(s) marked lost", len(lost))
        restored, removed = recover_interrupted_commits(self.config.resolved_checkpoint_dir)
        if restored or removed:
            log.warning("restart: %d checkpoint(s) restored from an interrupted overwrite, %d unfinished "
                        "temporary director(ies) removed", restored, removed)

    def sweep_expired_checkpoints(self) -> int:
        """Delete checkpoints whose TTL has passed (files first, then the record)."""
        expired = self.store.list_expired()
        for ck in expired:
            shutil.rmtree(ck.storage_path, ignore_errors=True)
            self.store.delete_checkpoint(ck.run_id, ck.kind, ck.name)
        if expired:
            log.info("removed %d expired checkpoint(s)", len(expired))
        return len(expired)

    def purge_old_requests(self) -> int:
        """Drop payloads and results of requests finished more than ``request_retention_s`` ago."""
        retention = self.config.request_retention_s
        if retention <= 0:
            return 0
        n = self.store.purge_request_payloads(datetime.now(timezone.utc) - timedelta(seconds=retention))
        if n:
            log.info("dropped the payloads and results of %d request(s) finished over %.0f s ago", n, retention)
        return n

    async def release_session_runs(self, session_id: str) -> int:
        """Unload a finished session's training runs (after their queued requests), freeing their slots.

        Saved checkpoints stay; the runs' unsaved in-memory state goes, as on the hosted service.
        """
        models = await asyncio.to_thread(self.store.list_session_models, session_id)
        live = [m for m in models if m.status == "active"]
        for m in live:
            await asyncio.to_thread(self.store.update_model_status, m.model_id, "unloaded")
            self.engine.submit(Job(f"internal-unload-{uuid.uuid4().hex}", "unload_model", m.model_id, None, None,
                                   internal=True))
        return len(live)

    def _expire_stale_sessions(self) -> list[str]:
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=self.config.session_timeout_s)
        expired = []
        for s in self.store.list_stale_sessions(cutoff):
            if self.store.finish_session(s.session_id, "interrupted",
                                         f"no heartbeat for {self.config.session_timeout_s:.0f} s"):
                expired.append(s.session_id)
        return expired

    def _until_next_session_expiry(self) -> float:
        """Seconds until the next unfinished session times out, if it sends no heartbeat.

        Heartbeats only push deadlines later, and a session created from now on times out no
        sooner than ``session_timeout_s`` from now, so sleeping this long misses nothing.
        """
        timeout = self.config.session_timeout_s
        earliest = self.store.earliest_live_heartbeat()
        if earliest is None:
            return timeout
        due = (earliest - datetime.now(timezone.utc)).total_seconds() + timeout
        return min(timeout, max(0.0, due) + SESSION_SWEEP_SLACK_S)

    async def _sweeper(self) -> None:
        """Expire sessions on time; every ``sweep_interval_s``, expired checkpoints, old payloads
        and the older points of long metric histories.

        Between rounds it sleeps until the next session deadline (one indexed query tells it)
        or the next periodic round, whichever is sooner: a session times out within a fraction
        of a second of its deadline, yet an idle server queries the database about once a
        minute.
        """
        loop = asyncio.get_running_loop()
        next_sweep = loop.time()
        while True:
            wait = min(self.sweep_interval_s, SWEEP_RETRY_S)  # unless this round tells otherwise
            try:
                if loop.time() >= next_sweep:
                    next_sweep = loop.time() + self.sweep_interval_s
                    await asyncio.to_thread(self.sweep_expired_checkpoints)
                    await asyncio.to_thread(self.purge_old_requests)
                    await asyncio.to_thread(self.store.thin_run_metrics, self.config.metric_history_points)
                for sid in await asyncio.to_thread(self._expire_stale_sessions):
                    n = await self.release_session_runs(sid)
                    log.info("session %s expired (no heartbeat); %d run(s) unloaded", sid, n)
                wait = await asyncio.to_thread(self._until_next_session_expiry)
            except Exception:
                log.exception("sweep failed")
            await asyncio.sleep(max(SESSION_SWEEP_SLACK_S, min(wait, next_sweep - loop.time())))

    async def flush_usage(self) -> None:
        """Write the token counts gathered since the last flush (one transaction)."""
        if self.usage is not None:
            await asyncio.to_thread(self.usage.flush)

    async def _flush_usage_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.usage_flush_s)
            try:
                await self.flush_usage()
            except Exception:
                log.exception("writing usage counts failed; they are kept for the next flush")

    async def _watch_keys_file(self) -> None:
        """Pick up edits of the API keys file within ``KEYS_POLL_S`` (SIGHUP reloads at once)."""
        while True:
            await asyncio.sleep(KEYS_POLL_S)
            try:
                await asyncio.to_thread(self.auth.reload_if_changed)
            except Exception:
                log.exception("checking the api keys file failed")

    def _on_sighup(self) -> None:
        if not self.auth.multi_tenant:
            log.info("SIGHUP: no --api-keys-file, nothing to reload")
            return
        asyncio.get_running_loop().run_in_executor(None, self.auth.reload)

    async def start(self) -> None:
        try:  # first: SIGHUP's default action would end the process, even while models load
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread (an embedded server): the file poll still reloads
        await asyncio.to_thread(self.prepare)
        log_startup_summary(self)
        await self.engine.start()
        self._tasks.append(asyncio.create_task(self._sweeper(), name="tinsmith-sweeper"))
        self._tasks.append(asyncio.create_task(self._flush_usage_loop(), name="tinsmith-usage-flush"))
        if self.auth.multi_tenant:
            self._tasks.append(asyncio.create_task(self._watch_keys_file(), name="tinsmith-keys-watch"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (ValueError, RuntimeError, NotImplementedError):
            pass
        await self.engine.stop()
        self.worker.close()
        try:
            await self.flush_usage()  # the last counts, after the engine has finished its work
        except Exception:
            log.exception("writing the last usage counts failed")
        self.release()
        self.store.close()


def _load_or_explain(load, source: str) -> None:
    try:
        load()
    except TinsmithError as e:
        raise StartupError(f"cannot load base model {source}: {e.message}") from e
    except torch.OutOfMemoryError as e:
        raise StartupError(f"cannot load base model {source}: out of device memory; serve fewer or smaller "
                           "models, or another --device") from e
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StartupError(f"cannot load base model {source}: {type(e).__name__}: {text}") from e


def _stop_after_losing_lease(current: LeaseRecord | None) -> None:
    """Another server took this one's database lease (it failed to renew it for a while):
    that server now owns the store, so this one shuts down rather than write to it too."""
    holder = "nobody" if current is None else f"host {current.host}, pid {current.pid}"
    log.error("another tinsmith server took over this database (now held by %s); shutting down", holder)
    os.kill(os.getpid(), signal.SIGTERM)


def _load_secret(data_dir: str) -> bytes:
    path = Path(data_dir) / "server-secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(secrets.token_bytes(32))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return path.read_bytes()
