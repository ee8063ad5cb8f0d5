"""The client venvs' installer: uv when there is one, pip for torch and wherever uv fails.

No registry is used: the "venv" is a stand-in interpreter that records the pip calls it gets, and
uv a stand-in that records its own and succeeds or fails as told.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.compat import venvs


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def spec(tmp_path, monkeypatch) -> venvs.VenvSpec:
    """A spec whose venv's python appends its arguments to ``calls`` (and exits 0)."""
    spec = venvs.VenvSpec(name="probe", steps=[["pkg==1"]], torch="2.0.0")
    monkeypatch.setattr(venvs.VenvSpec, "python", property(lambda self: tmp_path / "venv" / "bin" / "python"))
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    _script(tmp_path / "venv" / "bin" / "python", f'echo "pip $*" >> {tmp_path / "calls"}\n')
    return spec


def _uv(tmp_path: Path, monkeypatch, code: int) -> None:
    uv = _script(tmp_path / "uv", f'echo "uv $*" >> {tmp_path / "calls"}\nexit {code}\n')
    monkeypatch.setattr(venvs, "uv_binary", lambda: uv)


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_a_step_goes_to_uv_with_the_constraints_and_pips_index_settings(spec, tmp_path, monkeypatch):
    _uv(tmp_path, monkeypatch, 0)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://a.example/simple https://b.example/simple")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    venvs._install(spec, ["pkg==1"], tmp_path / "c.txt", tmp_path / "log")
    (call,) = _calls(tmp_path)
    assert call.startswith(f"uv pip install -q --python {spec.python} -c {tmp_path / 'c.txt'}")
    assert "--extra-index-url https://a.example/simple --extra-index-url https://b.example/simple pkg==1" in call


def test_a_step_uv_fails_is_run_again_by_pip(spec, tmp_path, monkeypatch):
    _uv(tmp_path, monkeypatch, 1)
    venvs._install(spec, ["pkg==1"], tmp_path / "c.txt", tmp_path / "log")
    uv_call, pip_call = _calls(tmp_path)
    assert uv_call.startswith("uv pip install")
    assert pip_call == f"pip -m pip install -q -c {tmp_path / 'c.txt'} pkg==1"
    assert "uv failed" in (tmp_path / "log").read_text()


def test_without_uv_pip_installs(spec, tmp_path, monkeypatch):
    monkeypatch.setattr(venvs, "uv_binary", lambda: None)
    venvs._install(spec, ["pkg==1"], tmp_path / "c.txt", tmp_path / "log")
    assert _calls(tmp_path) == [f"pip -m pip install -q -c {tmp_path / 'c.txt'} pkg==1"]


def test_torch_is_installed_first_and_by_pip_even_with_uv(spec, tmp_path, monkeypatch):
    _uv(tmp_path, monkeypatch, 0)
    monkeypatch.setattr(venvs, "VENVS", tmp_path / "venvs")
    monkeypatch.setattr(venvs, "_run", _recording_run(tmp_path, spec))
    venvs.ensure_venv(spec)
    calls = _calls(tmp_path)
    assert calls[0] == f"venv {spec.path}"
    assert calls[1].startswith("pip -m pip install -q -c ") and calls[1].endswith(" torch==2.0.0")
    assert calls[2].startswith("uv pip install") and calls[2].endswith(" pkg==1")
    assert calls[3].startswith("pip -c ")  # the spec's check, in the venv
    assert (spec.path / ".compat-ok").exists()


def _recording_run(tmp_path: Path, spec: venvs.VenvSpec):
    """``venvs._run`` that records instead of running, except the stand-in uv (so its result counts)."""
    real = venvs._run

    def run(cmd: list[str], log: Path) -> None:
        if cmd[1:3] == ["-m", "venv"]:
            spec.path.mkdir(parents=True, exist_ok=True)
            with open(tmp_path / "calls", "a") as f:
                f.write(f"venv {cmd[3]}\n")
            return
        real(cmd, log)

    return run


def test_a_changed_torch_pin_is_another_venv():
    a = venvs.VenvSpec(name="x", steps=[["p"]], torch="2.0.0")
    b = venvs.VenvSpec(name="x", steps=[["p"]], torch="2.1.0")
    assert a.key != b.key
