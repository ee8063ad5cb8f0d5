"""Run the real ``tinsmith serve`` as a subprocess for end-to-end tests.

A :class:`ServerProcess` picks a free port, starts the server on a data directory, waits for
``GET /api/v1/healthz`` and can be stopped (SIGTERM, then SIGKILL), killed outright (``kill -9``)
and started again on the same data directory and port. Every failure message carries the tail
of the server's log, which is written to ``{log_dir}/server-N.log`` (one file per start).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class ServerProcess:
    """One tinsmith server: ``start()``, ``stop()``, ``kill()``, ``restart()``."""

    def __init__(
        self,
        base_model: str | Path,
        data_dir: str | Path,
        *,
        port: int | None = None,
        database_url: str | None = None,
        api_keys_file: str | Path | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_dir: str | Path | None = None,
        checkout: str | Path | None = None,
    ) -> None:
        self.base_model = str(base_model)
        # Whose tinsmith runs: this checkout's, or another's (benchmarks compare two commits).
        self.checkout = Path(checkout) if checkout is not None else Path(__file__).resolve().parents[2]
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.database_url = database_url
        self.api_keys_file = None if api_keys_file is None else str(api_keys_file)
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.log_dir = Path(log_dir) if log_dir is not None else self.data_dir
        self.proc: subprocess.Popen | None = None
        self.forced_kill = False  # the last stop() had to SIGKILL after SIGTERM timed out
        self.starts = 0
        self.log_path: Path | None = None
        self._log_file = None

    # ------------------------------------------------------------------------------ addresses
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "tinsmith.cli", "serve", "--base-model", self.base_model,
               "--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        if self.database_url:
            cmd += ["--database-url", self.database_url]
        if self.api_keys_file:
            cmd += ["--api-keys-file", self.api_keys_file]
        return cmd + self.extra_args

    # ------------------------------------------------------------------------------ logs
    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        if self._log_file is not None:
            self._log_file.flush()
        return self.log_path.read_text(errors="replace")

    def all_logs(self) -> str:
        """Every start's log, oldest first."""
        parts = []
        for i in range(1, self.starts + 1):
            p = self.log_dir / f"server-{self.port}-{i}.log"
            if p.exists():
                parts.append(f"--- start {i} ---\n" + p.read_text(errors="replace"))
        return "\n".join(parts)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        if self.running:
            raise ServerError("server is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.log_path = self.log_dir / f"server-{self.port}-{self.starts}.log"
        self._log_file = open(self.log_path, "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(self.checkout))
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(
                    f"tinsmith server exited with code {self.proc.returncode} during start-up.\n"
                    f"command: {' '.join(self.command())}\nlog:\n{self.log_tail()}"
                )
            try:
                r = httpx.get(self.base_url + "/api/v1/healthz", timeout=2.0)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.1)
        self._terminate()
        raise ServerError(
            f"tinsmith server not healthy after {timeout:.0f} s (last: {last}).\n"
            f"command: {' '.join(self.command())}\nlog:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in ``timeout`` seconds (``forced_kill``).

        Returns the exit code (uvicorn re-raises SIGTERM after a clean shutdown: -15 is normal).
        """
        return self._terminate(timeout)

    def kill(self) -> None:
        """``kill -9``: no shutdown code runs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._close_log()

    def restart(self, *, kill: bool = False, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        """Stop (gracefully, or ``kill -9`` with ``kill=True``) and start again on the same port and data."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(timeout)

    def _terminate(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        if self.proc is None:
            return None
        self.forced_kill = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.forced_kill = True
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
