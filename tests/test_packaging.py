"""What ships: the wheel (its extras and package data) and the Docker files agree with the code.

The compose file is checked against the server's real options, so that renaming an option
cannot leave the documented container set-up silently ignoring a setting.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import yaml

from tinsmith.server.config import ENV_PREFIX, ServerConfig

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker" / "compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("tinsmith-*.whl")
    return path


def test_wheel_declares_the_extras_and_keeps_optional_packages_out_of_core(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode())
    extras = set(meta.get_all("Provides-Extra"))
    assert {"postgres", "gpu", "demo", "test"} <= extras
    core = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    for optional in ("matplotlib", "psycopg", "nvidia-ml-py", "pytest", "triton"):
        assert not any(r.startswith(optional) for r in core), (optional, core)


def test_wheel_carries_migrations_and_runs_them(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert any(n.startswith("tinsmith/store/migrations/versions/0001") for n in names)
    assert {"tinsmith/api/dashboard/index.html", "tinsmith/api/dashboard/dashboard.js"} <= set(names)
    # the unpacked wheel, not the checkout, migrates a fresh database
    code = ("import tinsmith, sys; from tinsmith.store import Store; "
            f"assert tinsmith.__file__.startswith({str(tmp_path / 'site')!r}), tinsmith.__file__; "
            f"Store({('sqlite:///' + str(tmp_path / 'db.sqlite'))!r}).migrate(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_compose_sets_only_real_options_and_builds_the_dockerfile():
    compose = yaml.safe_load(COMPOSE.read_text())
    server = compose["services"]["tinsmith"]
    assert (COMPOSE.parent / server["build"]["context"] / server["build"]["dockerfile"]).resolve() == DOCKERFILE
    options = {ENV_PREFIX + name.upper() for name in ServerConfig.model_fields}
    env = server["environment"]
    set_here = [k for k in env if k.startswith(ENV_PREFIX)]
    assert set_here and not set(set_here) - options, set(set_here) - options
    assert env["TINSMITH_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    for line in DOCKERFILE.read_text().splitlines():  # ENV lines of the image set real options too
        for name in re.findall(rf"\b({ENV_PREFIX}[A-Z_]+)=", line):
            assert name in options, name


def test_dockerfile_installs_extras_the_package_has():
    text = DOCKERFILE.read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    for extras in re.findall(r"extras=([a-z,]+)", text):
        for extra in extras.split(","):
            assert re.search(rf"^{extra} = ", pyproject, re.M), extra


def _compose_command() -> list[str] | None:
    """``docker compose`` (the plugin) or the older ``docker-compose``, whichever is here."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_validates_the_file():
    compose = _compose_command()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin"}
    ok = subprocess.run([*compose, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                        env={**env, "TINSMITH_BASE_MODEL": "Qwen/Qwen3-0.6B"})
    assert ok.returncode == 0, ok.stderr
    unset = subprocess.run([*compose, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                           env=env)
    assert unset.returncode != 0 and "TINSMITH_BASE_MODEL" in unset.stderr
