"""Fixtures of the tinker-cookbook compatibility suite.

Session-wide: the cached cookbook venv (``venvs.py``), the cached offline mirror (``mirror.py``),
one ``tinsmith serve`` serving every mirrored model id, and a working directory of symlinks to
the mirror. ``cookbook`` runs a recipe module or a script from ``scripts/`` in the cookbook venv,
from that directory, with the hub and datasets forced offline, and returns a :class:`Run`.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.compat import mirror as mirror_mod
from tests.compat.helpers import Run
from tests.compat.venvs import VenvUnavailable, cookbook_spec, ensure_venv
from tests.e2e.server import ServerProcess

SCRIPTS = Path(__file__).resolve().parent / "scripts"
API_KEY = "tml-compat"
RUN_TIMEOUT_S = 600
# The suite checks what clients see, not device numerics: the server runs on the CPU everywhere, so
# the logprob tolerances below hold on any machine (a GPU server computes in bf16).
SERVER_ARGS = ["--device", "cpu"]


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    try:
        return ensure_venv(cookbook_spec())
    except VenvUnavailable as e:
        pytest.skip(f"tinker-cookbook venv unavailable: {e}")


@pytest.fixture(scope="session")
def cookbook_data(cookbook_python) -> Path:
    """The ``example_data`` folder shipped in the installed tinker-cookbook wheel."""
    code = "import os, tinker_cookbook as t; print(os.path.dirname(t.__file__))"
    out = subprocess.run([str(cookbook_python), "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return Path(out.stdout.strip()) / "example_data"


@pytest.fixture(scope="session")
def compat_mirror(cookbook_python) -> Path:
    return mirror_mod.ensure_mirror(cookbook_python)


@pytest.fixture(scope="session")
def compat_workdir(compat_mirror, tmp_path_factory) -> Path:
    return mirror_mod.link_workdir(compat_mirror, tmp_path_factory.mktemp("compat-cwd"))


@pytest.fixture(scope="session")
def compat_server(compat_mirror, tmp_path_factory) -> Iterator[ServerProcess]:
    base, alias_args = mirror_mod.server_args(compat_mirror)
    data = tmp_path_factory.mktemp("compat-server")
    srv = ServerProcess(base, data, extra_args=alias_args + SERVER_ARGS, log_dir=data / "logs")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def compat_env(compat_server, tmp_path_factory) -> dict[str, str]:
    """The environment every cookbook process gets: offline hub, local server, no trackers."""
    hf = tmp_path_factory.mktemp("compat-hf-home")
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}
    return {
        **keep,
        "HF_HOME": str(hf), "HF_DATASETS_CACHE": str(hf / "datasets"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TINKER_BASE_URL": compat_server.base_url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
        "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path_factory.mktemp("compat-default-runs")),
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }


@pytest.fixture(scope="session")
def cookbook(cookbook_python, compat_workdir, compat_env, compat_server, tmp_path_factory) -> Callable[..., Run]:
    """``cookbook(target, *args, name=..., log_path=None)`` -> :class:`Run`; fails with both logs' tails.

    ``target`` is a module (``tinker_cookbook.recipes.sl_loop``, run with ``log_path=DIR``
    appended) or a file under ``scripts/`` (``custom_rl.py``, run with ``--log-path=DIR``). The
    log dir is ``log_path`` or a fresh one named after ``name``/the target (not passed on with
    ``pass_log_path=False``, for recipes without that option). ``env`` adds environment variables.
    """
    runs = tmp_path_factory.mktemp("compat-runs")

    def run(target: str, *args: str, name: str | None = None, log_path: Path | None = None,
            pass_log_path: bool = True, env: dict[str, str] | None = None, expect_rc: int = 0,
            timeout: float = RUN_TIMEOUT_S) -> Run:
        lp = log_path or runs / (name or target.removeprefix("tinker_cookbook.recipes.").replace(".", "_"))
        cmd = [str(cookbook_python)]
        if target.endswith(".py"):  # our scripts take argparse flags
            cmd += [str(SCRIPTS / target), *args] + ([f"--log-path={lp}"] if pass_log_path else [])
        else:  # chz recipe entry points take key=value
            cmd += ["-m", target, *args] + ([f"log_path={lp}"] if pass_log_path else [])
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=compat_workdir, env={**compat_env, **(env or {})}, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"")[-6000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-6000:]
            pytest.fail(f"{target} timed out after {timeout:.0f} s\n$ {' '.join(cmd)}\n--- output tail\n{out}\n"
                        f"--- server log tail\n{compat_server.log_tail(40)}")
        output = proc.stdout + proc.stderr
        elapsed = time.monotonic() - t0
        if proc.returncode != expect_rc:
            pytest.fail(f"{target} exited {proc.returncode} (want {expect_rc}) after {elapsed:.0f} s\n"
                        f"$ cd {compat_workdir} && {' '.join(cmd)}\n--- output tail\n{output[-8000:]}\n"
                        f"--- server log tail\n{compat_server.log_tail(60)}")
        return Run(Path(lp), output)

    return run


@pytest.fixture(scope="session")
def service_client(compat_server):
    """A 0.38 SDK client (in-process) for checking what recipes left on the server."""
    import tinker

    sc = tinker.ServiceClient(base_url=compat_server.base_url, api_key=API_KEY)
    yield sc
    try:
        sc.close("success").result(timeout=60)
    except Exception:  # noqa: BLE001 - the server may already be gone at teardown
        pass


PROBE_TEXT = "User: What is 1 plus 1?\n\nAssistant: \\boxed{1}"


@pytest.fixture(scope="session")
def check_final_checkpoint(service_client, compat_server, compat_mirror) -> Callable[..., dict]:
    """Load a run's ``final`` checkpoint in this process, both ways, and compare them.

    * ``create_training_client_from_state(state_path)`` -> ``forward`` logprobs of a probe text;
    * ``create_sampling_client(model_path=sampler_path)`` -> ``compute_logprobs`` of the same text;
    * the two agree (same weights), and differ from the base model's (the run trained);
    * the training run found by ``RestClient.get_training_run_by_tinker_path`` names the
      expected base model (and renderer, when the recipe recorded one).
    """
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    service_client_base_url = compat_server.base_url
    tok = AutoTokenizer.from_pretrained(str(compat_mirror / mirror_mod.STUDENT))
    probe = tok.encode(PROBE_TEXT, add_special_tokens=False)

    def check(record: dict, *, base_model: str, renderer_name: str | None = None,
              trained: bool = True) -> dict:
        tc = service_client.create_training_client_from_state(record["state_path"]).result(timeout=120)
        datum = types.Datum(model_input=types.ModelInput.from_ints(probe[:-1]),
                            loss_fn_inputs={"target_tokens": probe[1:]})
        fwd = tc.forward([datum], "cross_entropy").result(timeout=120)
        state_lp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
        sampler = service_client.create_sampling_client(model_path=record["sampler_path"]).result(timeout=120)
        sampler_lp = np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(probe)).result(timeout=120)[1:],
                                dtype=np.float64)
        base = service_client.create_sampling_client(base_model=base_model).result(timeout=120)
        base_lp = np.asarray(base.compute_logprobs(types.ModelInput.from_ints(probe)).result(timeout=120)[1:],
                             dtype=np.float64)
        assert state_lp.shape == sampler_lp.shape == (len(probe) - 1,)
        assert np.all(np.isfinite(state_lp)) and np.all(state_lp <= 0)
        np.testing.assert_allclose(state_lp, sampler_lp, atol=2e-4,
                                   err_msg="final state and final sampler weights disagree")
        diff = float(np.max(np.abs(state_lp - base_lp)))
        if trained:
            assert diff > 1e-5, f"final checkpoint equals the base model (max |dlogp| {diff:g})"
        rest = tinker.RestClient(base_url=service_client_base_url, api_key=API_KEY)
        run = rest.get_training_run_by_tinker_path(record["state_path"]).result(timeout=60)
        assert run.base_model == base_model, run
        assert run.is_lora, run
        if renderer_name is not None:
            assert (run.user_metadata or {}).get("renderer_name") == renderer_name, run.user_metadata
        return {"max_abs_dlogp_vs_base": diff, "run": run}

    return check
