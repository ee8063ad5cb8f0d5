"""Reading and checking what a cookbook run wrote under its ``log_path``."""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STATE_PATH = re.compile(r"^tinker://[^/\s]+/weights/[^/\s]+$")
SAMPLER_PATH = re.compile(r"^tinker://[^/\s]+/sampler_weights/[^/\s]+$")


def read_jsonl(path: Path) -> list[dict]:
    assert path.exists(), f"{path} was not written"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows, f"{path} is empty"
    return rows


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _is_tail_row(row: dict) -> bool:
    return all(k == "step" or k.startswith(("tokens/", "test/")) for k in row)


@dataclass
class Run:
    """One recipe run: its log dir and the subprocess' combined output."""

    log_path: Path
    output: str

    @property
    def metrics(self) -> list[dict]:
        return read_jsonl(self.log_path / "metrics.jsonl")

    @property
    def checkpoints(self) -> list[dict]:
        return read_jsonl(self.log_path / "checkpoints.jsonl")

    @property
    def tail_rows(self) -> list[dict]:
        return [r for r in self.metrics if _is_tail_row(r)]

    def column(self, key: str) -> list:
        """Every value of ``key`` across metrics rows (rows without it are skipped)."""
        return [r[key] for r in self.metrics if key in r]

    def check_metrics(self, *, steps: list[int] | None = None, keys: tuple[str, ...] = ()) -> list[dict]:
        """Rows are numbered ``steps`` (when given), carry every one of ``keys``, and every number is finite.

        rl.train ends with rows holding only a last test-set evaluation (``test/...``) and the
        cumulative token counts (``tokens/...``); they are checked for finite values and left out
        of the returned rows (see :attr:`tail_rows`).
        """
        rows = []
        for r in self.metrics:
            bad = {k: v for k, v in _numbers(r).items() if not math.isfinite(v)}
            assert not bad, f"step {r.get('step')}: non-finite metrics {bad}"
            if not _is_tail_row(r):
                rows.append(r)
        if steps is not None:
            assert [r["step"] for r in rows] == steps, f"metrics steps {[r['step'] for r in rows]} != {steps}"
        for r in rows:
            missing = [k for k in keys if k not in r]
            assert not missing, f"step {r.get('step')}: metrics lack {missing}; have {sorted(r)}"
        return rows

    def check_checkpoints(self, names: list[str], *, sampler: set[str] | None = None) -> list[dict]:
        """``checkpoints.jsonl`` holds exactly ``names`` in order, with well-formed tinker:// paths.

        ``sampler`` names the entries that must also carry a ``sampler_path`` (default: "final").
        """
        rows = self.checkpoints
        assert [r["name"] for r in rows] == names, f"checkpoint names {[r['name'] for r in rows]} != {names}"
        want_sampler = {"final"} if sampler is None else sampler
        for r in rows:
            assert STATE_PATH.match(r["state_path"]), r
            assert r["state_path"].endswith("/weights/" + r["name"]), r
            if r["name"] in want_sampler:
                assert "sampler_path" in r and SAMPLER_PATH.match(r["sampler_path"]), r
                assert r["sampler_path"].endswith("/sampler_weights/" + r["name"]), r
        return rows


def run_id_of(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


# ------------------------------------------------------------------------------ the server's own record
# What reached the server, read from its SQLite store (read-only): request kinds per training run,
# load requests, and sampling sessions on bare base models.
def _db(server) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{server.data_dir / 'tinsmith.sqlite'}?mode=ro", uri=True)


def request_kinds(server, model_id: str) -> Counter:
    """How many requests of each kind (forward_backward, optim_step, load_weights ...) one run got."""
    with _db(server) as con:
        rows = con.execute("SELECT kind, COUNT(*) FROM requests WHERE model_id = ? GROUP BY kind", (model_id,))
        return Counter(dict(rows.fetchall()))


def load_requests(server, model_id: str) -> list[dict]:
    """The JSON bodies of the load_weights requests that created or filled one run."""
    with _db(server) as con:
        rows = con.execute("SELECT payload FROM requests WHERE model_id = ? AND kind = 'load_weights'", (model_id,))
        return [json.loads(p) for (p,) in rows.fetchall()]


def base_model_sampling_sessions(server, base_model: str) -> int:
    """Sampling sessions opened on ``base_model`` itself (no model_path): teachers, judges, answerers."""
    with _db(server) as con:
        (n,) = con.execute("SELECT COUNT(*) FROM sampling_sessions WHERE base_model = ? AND model_path IS NULL",
                           (base_model,)).fetchone()
        return n


def sampling_sessions_on(server, model_path: str) -> int:
    """Sampling sessions opened on saved sampler weights (``create_sampling_client(model_path=...)``)."""
    with _db(server) as con:
        (n,) = con.execute("SELECT COUNT(*) FROM sampling_sessions WHERE model_path = ?", (model_path,)).fetchone()
        return n
