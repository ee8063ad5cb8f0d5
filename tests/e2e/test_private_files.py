"""The server's files are private: every directory 0700, every file 0600.

A data dir left open by an older run (0755 directories, 0644 files) is tightened at start-up;
what the server writes afterwards (SQLite and its -wal/-shm, every kind of checkpoint, the lock
file, the secret) is born private. ``tinsmith export`` and signed downloads still work, and
export writes with the caller's own umask.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, lora_client, sft_batch, train_steps
from tinsmith.store import Store

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _modes(root: Path) -> dict[str, str]:
    """relative path -> octal permission bits of everything under ``root`` (and root itself)."""
    out = {".": oct(stat.S_IMODE(root.stat().st_mode))}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(parent) / name
            out[str(p.relative_to(root))] = oct(stat.S_IMODE(p.lstat().st_mode))
    return out


def _older_run(data_dir: Path) -> Path:
    """What a server without private files left: an open data dir, database and checkpoint."""
    old = os.umask(0o022)
    try:
        data_dir.mkdir(mode=0o755)
        with Store(Store.default_sqlite_url(data_dir)) as store:
            store.migrate()
        ckpt = data_dir / "checkpoints" / "old-run:train:0" / "weights" / "old"
        ckpt.mkdir(parents=True)
        (ckpt / "weights.safetensors").write_bytes(b"old")
        (data_dir / "server-secret").write_bytes(os.urandom(32))
        os.chmod(data_dir / "server-secret", 0o644)
    finally:
        os.umask(old)
    assert _modes(data_dir)["checkpoints/old-run:train:0/weights/old/weights.safetensors"] == oct(0o644)
    return ckpt


def test_data_dir_and_checkpoints_are_private(make_server, service_client, base_model, tmp_path):
    data_dir = tmp_path / "data"
    old_ckpt = _older_run(data_dir)
    srv = make_server(data_dir=data_dir, log_dir=tmp_path / "logs")  # logs are the test's, not the server's
    sc = service_client(srv)
    tc = lora_client(sc, base_model, rank=4, seed=0)
    train_steps(tc, sft_batch(seed=1, n_seqs=2, seq_len=12, vocab=VOCAB), steps=1)
    state = tc.save_state("s").result(timeout=RESULT_TIMEOUT_S).path
    tc.save_weights_for_sampler("w").result(timeout=RESULT_TIMEOUT_S)
    external = tc.save_weights_external("e").result(timeout=RESULT_TIMEOUT_S).path

    modes = _modes(data_dir)
    assert (data_dir / "tinsmith.sqlite-wal").exists() and (data_dir / "tinsmith.lock").exists()
    kinds = {Path(p).parts[2] for p in modes if p.startswith("checkpoints/") and len(Path(p).parts) > 2}
    assert {"weights", "sampler_weights", "external_weights"} <= kinds, sorted(modes)
    assert any(p.endswith("adapter_config.json") for p in modes)
    wrong = {p: m for p, m in modes.items()
             if m != (oct(0o700) if (data_dir / p).is_dir() else oct(0o600))}
    assert wrong == {}, wrong
    assert old_ckpt.is_dir()  # tightened, not touched otherwise

    # signed downloads are served from the private files
    run_id, name = external.removeprefix("tinker://").split("/external_weights/")
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": "tml-e2e"}, timeout=30) as http:
        urls = http.get(f"/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")
        assert urls.status_code == 200, urls.text
        url = urls.json()["urls"]["adapter_config.json"]
        got = httpx.get(url, timeout=30)
        assert got.status_code == 200 and got.json()["peft_type"] == "LORA"

    # export runs as the user, with the user's umask: what it writes is not made private
    # (safetensors itself always writes its files 0600, so look at the JSON it writes)
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "tinsmith.cli", "export", state, "--out", str(out),
                        "--data-dir", str(data_dir)], cwd=str(REPO), capture_output=True, text=True,
                       timeout=300, umask=0o022)
    assert r.returncode == 0, r.stderr
    assert _modes(out)["."] == oct(0o755) and _modes(out)["config.json"] == oct(0o644)
    assert (out / "model.safetensors").is_file()
