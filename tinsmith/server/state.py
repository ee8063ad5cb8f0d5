"""Builds and owns the running server's parts: store, worker, engine and authenticator."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import uuid
from datetime import datetime, timedelta, timezone
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinsmith.api.auth import Authenticator
from tinsmith.checkpoints.peft_format import recover_interrupted_commits
from tinsmith.engine.scheduler import Engine, Job
from tinsmith.server.config import ServerConfig
from tinsmith.server.operations import WorkerOperations
from tinsmith.store import Store
from tinsmith.worker.service import RuntimeOptions, Worker

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    worker: Worker
    engine: Engine
    auth: Authenticator
    secret: bytes = b""  # signs download links; kept in the data dir so links survive restarts
    sweep_interval_s: float = 60.0
    _tasks: list = field(default_factory=list)

    @classmethod
    def build(cls, config: ServerConfig) -> "ServerState":
        if not config.base_model:
            raise ValueError("no base model: pass --base-model ID_OR_DIR (or TINSMITH_BASE_MODEL)")
        store = Store(config.resolved_database_url)
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        worker = Worker(
            RuntimeOptions(
                device=device,
                max_lora_adapters=config.max_lora_adapters,
                max_lora_rank=config.max_lora_rank,
                max_training_runs=config.max_training_runs,
                micro_batch_tokens=config.train_micro_batch_tokens,
                micro_batch_seqs=config.train_micro_batch_size or (1 << 30),
                gradient_checkpointing=config.gradient_checkpointing,
                max_full_finetunes=config.max_full_finetunes,
            )
        )
        engine = Engine(WorkerOperations(worker, store), store)
        return cls(config, store, worker, engine, Authenticator(config.api_keys_file), _load_secret(config.data_dir))

    def load_models(self) -> None:
        """Load every base model (blocking; done once at start-up)."""
        for name in self.config.base_model:
            self.worker.add_base_model(name)
        for alias, target in self.config.aliases().items():
            if target in self.worker.bases:
                self.worker.add_alias(alias, target)
            else:
                self.worker.add_base_model(alias, target)

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

    async def _sweeper(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep_expired_checkpoints)
                for sid in await asyncio.to_thread(self._expire_stale_sessions):
                    n = await self.release_session_runs(sid)
                    log.info("session %s expired (no heartbeat); %d run(s) unloaded", sid, n)
            except Exception:
                log.exception("sweep failed")
            await asyncio.sleep(self.sweep_interval_s)

    async def start(self) -> None:
        await asyncio.to_thread(self.store.migrate)
        await asyncio.to_thread(self.recover_after_restart)
        await asyncio.to_thread(self.load_models)
        await self.engine.start()
        self._tasks.append(asyncio.create_task(self._sweeper(), name="tinsmith-checkpoint-sweeper"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.engine.stop()
        self.store.close()


def _load_secret(data_dir: str) -> bytes:
    path = Path(data_dir) / "server-secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(secrets.token_bytes(32))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return path.read_bytes()
