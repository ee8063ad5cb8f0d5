"""Cached client virtualenvs for the compatibility suite (cookbook, and one per tinker SDK version).

The cookbook runs in its own venv, not in ``.venv``: the client side of a real deployment is a
separate environment anyway, installing ``datasets``/``chz``/``math-verify`` and friends into the
server's venv would change packages under tests that others run concurrently, and
``tinker-cookbook==0.6.1`` cannot be installed with its declared dependencies at all (it asks for
``tml-renderers>=0.4.1``, which the registry does not have). So the cookbook is installed with
``--no-deps`` next to the explicit requirement list, under a constraints file that pins ``torch``,
``tinker``, ``transformers`` and ``tokenizers`` to the versions of ``.venv`` (torch is installed
first, the same way ``scripts/setup`` does, so a local CPU build is used and nothing pulls a CUDA
or newer torch).

Torch goes in through pip, which follows the machine's pip configuration (where a local build
lies); every other package through uv where ``.venv`` has it (the ``test`` extra brings it): pip's
resolver and installer spent about 35 s of CPU on each SDK venv and about 100 s on the cookbook's
requirements, uv about 2 s. A step uv fails is run again by pip.

Every venv lives under ``.compat/venvs/<name>-<key>`` (``TINSMITH_COMPAT_DIR`` overrides
``.compat``), where the key hashes the full install recipe and the interpreter version; it is built
once, marked complete with a ``.compat-ok`` file, and reused by later runs. A lock file keeps two
concurrent test runs from building the same venv at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPAT_DIR = Path(os.environ.get("TINSMITH_COMPAT_DIR", REPO / ".compat"))
VENVS = COMPAT_DIR / "venvs"
INSTALL_TIMEOUT_S = 1200

COOKBOOK_VERSION = "0.6.1"
# tinker-cookbook 0.6.1's own requirements (METADATA), minus tml-renderers (not on the registry;
# imported lazily for the Inkling/Kimi-K3.1 models only), plus the math-rl extra.
COOKBOOK_REQUIREMENTS = [
    "aiohttp>=3.9.0", "anyio>=4.0.0", "blobfile>=3.0.0", "chz>=0.4.0", "cloudpickle>=3.0.0",
    "datasets>=2.14.0", "huggingface-hub>=0.20.0", "numpy>=1.24.0", "pillow>=10.0.0",
    "pydantic>=2.0.0", "pyrage>=1.4.0", "rich>=13.0.0", "safetensors>=0.4.0", "termcolor>=2.0.0",
    "tiktoken>=0.12.0", "tqdm>=4.60.0",
    "transformers!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*,>=4.57.6",
    # [math-rl] extra: rl_loop, rl_basic, math_rl
    "math-verify>=0.5.0", "pylatexenc>=2.0", "sympy>=1.12.0",
]


class VenvUnavailable(RuntimeError):
    """The venv could not be built because the package registry is out of reach."""


def _base_version(dist: str) -> str:
    return metadata.version(dist).split("+")[0]


def main_pins() -> dict[str, str]:
    """The versions of ``.venv`` that every client venv must share."""
    return {d: _base_version(d) for d in ("torch", "tinker", "transformers", "tokenizers")}


@dataclass
class VenvSpec:
    name: str
    steps: list[list[str]]  # install argument lists, run in order (uv, else pip)
    constraints: dict[str, str] = field(default_factory=dict)
    check: str = "import sys"  # python code that must run in the finished venv
    torch: str | None = None  # torch's version, installed first and by pip (its local build)

    @property
    def key(self) -> str:
        blob = json.dumps({"steps": self.steps, "constraints": self.constraints, "check": self.check,
                           "torch": self.torch, "python": sys.version_info[:3]}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def path(self) -> Path:
        return VENVS / f"{self.name}-{self.key}"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def cookbook_spec() -> VenvSpec:
    pins = main_pins()
    return VenvSpec(
        name=f"cookbook-{COOKBOOK_VERSION}-tinker-{pins['tinker']}",
        constraints=pins,
        torch=pins["torch"],
        steps=[
            ["--no-deps", f"tinker-cookbook=={COOKBOOK_VERSION}"],
            [f"tinker=={pins['tinker']}", *COOKBOOK_REQUIREMENTS],
        ],
        check=(
            "import torch, tinker, tinker_cookbook, datasets, chz, math_verify; from importlib import metadata as m; "
            f"assert torch.__version__.split('+')[0] == {pins['torch']!r}, torch.__version__; "
            f"assert m.version('tinker') == {pins['tinker']!r}; "
            f"assert m.version('tinker-cookbook') == {COOKBOOK_VERSION!r}"
        ),
    )


def sdk_spec(version: str) -> VenvSpec:
    """A venv with only ``tinker==version`` (and numpy), sharing ``.venv``'s transformers."""
    pins = main_pins()
    constraints = {"transformers": pins["transformers"], "tokenizers": pins["tokenizers"]}
    return VenvSpec(
        name=f"sdk-{version}",
        constraints=constraints,
        steps=[[f"tinker=={version}", "numpy"]],
        check=f"from importlib import metadata as m; assert m.version('tinker') == {version!r}",
    )


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def uv_binary() -> Path | None:
    """The uv next to this interpreter (``.venv``'s, from the ``test`` extra), else on PATH."""
    beside = Path(sys.executable).with_name("uv")
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("uv")
    return None if found is None else Path(found)


def _install(spec: VenvSpec, step: list[str], constraints: Path, log: Path) -> None:
    """One install step into ``spec``'s venv: by uv where there is one, by pip otherwise or if
    uv fails (pip's index settings from the environment are handed to uv too)."""
    uv = uv_binary()
    if uv is not None:
        sources = []
        for variable, option in (("PIP_INDEX_URL", "--index-url"), ("PIP_EXTRA_INDEX_URL", "--extra-index-url"),
                                 ("PIP_FIND_LINKS", "--find-links")):
            for value in os.environ.get(variable, "").split():
                sources += [option, value]
        try:
            _run([str(uv), "pip", "install", "-q", "--python", str(spec.python), "-c", str(constraints), *sources,
                  *step], log)
            return
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            with open(log, "a") as f:
                f.write("uv failed; the same step by pip\n")
    _run([str(spec.python), "-m", "pip", "install", "-q", "-c", str(constraints), *step], log)


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def registry_reachable(python: Path | str = sys.executable) -> bool:
    """Can pip fetch a small package index page right now (honouring the user's pip config)?"""
    with contextlib.suppress(Exception):
        tmp = COMPAT_DIR / "probe"
        tmp.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([str(python), "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
                               f"tinker-cookbook=={COOKBOOK_VERSION}"], capture_output=True, timeout=120)
        return proc.returncode == 0
    return False


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_venv(spec: VenvSpec) -> Path:
    """Build ``spec``'s venv unless a complete one is cached; return its python.

    Raises :class:`VenvUnavailable` when the install fails and the registry is unreachable, and
    ``RuntimeError`` (with the pip log's tail) when it fails for any other reason.
    """
    ok = spec.path / ".compat-ok"
    if ok.exists():
        return spec.python
    with _lock(VENVS / f".{spec.name}-{spec.key}.lock"):
        if ok.exists():
            return spec.python
        if spec.path.exists():
            shutil.rmtree(spec.path)
        VENVS.mkdir(parents=True, exist_ok=True)
        log = VENVS / f"{spec.name}-{spec.key}.log"
        log.write_text(f"building {spec.name} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        constraints = spec.path / "constraints.txt"
        try:
            _run([sys.executable, "-m", "venv", str(spec.path)], log)
            constraints.write_text("".join(f"{k}=={v}\n" for k, v in spec.constraints.items()))
            if spec.torch is not None:
                _run([str(spec.python), "-m", "pip", "install", "-q", "-c", str(constraints),
                      f"torch=={spec.torch}"], log)
            for step in spec.steps:
                _install(spec, step, constraints, log)
            _run([str(spec.python), "-c", spec.check], log)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(spec.path, ignore_errors=True)
            if not registry_reachable():
                raise VenvUnavailable(
                    f"cannot build the {spec.name} venv: the package registry is unreachable "
                    f"(pip log {log}):\n{_tail(log, 8)}") from e
            raise RuntimeError(f"building the {spec.name} venv failed ({e}); pip log {log}:\n{_tail(log)}") from e
        ok.write_text(json.dumps({"torch": spec.torch, "steps": spec.steps, "constraints": spec.constraints},
                                 indent=1))
        return spec.python


if __name__ == "__main__":  # python -m tests.compat.venvs [cookbook|SDK_VERSION ...]: pre-build venvs
    for arg in sys.argv[1:] or ["cookbook"]:
        spec = cookbook_spec() if arg == "cookbook" else sdk_spec(arg)
        t = time.monotonic()
        print(ensure_venv(spec), f"{time.monotonic() - t:.0f}s", flush=True)
