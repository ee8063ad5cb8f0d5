"""Start-up checks that run before anything slow: is the port free, can each model be found?

Loading a big model takes minutes, so every mistake that can be seen cheaply (a port in use, a
typo in a model id, a directory without ``config.json``, an architecture tinsmith cannot run)
is refused first, as one line with a hint (``StartupError``), before the database is opened
or a weight is read.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from tinsmith.errors import TinsmithError


class StartupError(Exception):
    """The server cannot start; ``str()`` is one line ending in a hint."""


def bind_listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Take ``host:port`` now and keep it, so the port cannot be taken while models load.

    Binds the way uvicorn does (``SO_REUSEADDR``, for a restart while old connections linger
    in TIME_WAIT; IPv6 when the host has a colon) and listens at once: on Linux two sockets
    with ``SO_REUSEADDR`` may share a port until one listens. A client that connects while
    models load waits in the backlog; uvicorn serves the socket once start-up is done.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"--port {port} is in use on {host}; pick another with --port or TINSMITH_PORT "
                               "(or stop the process holding it)") from None
        if e.errno == errno.EACCES:
            raise StartupError(f"--port {port} needs privileges on this machine; pick one above 1023 "
                               "with --port or TINSMITH_PORT") from None
        raise StartupError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}; --host must be an "
                           "address of this machine (127.0.0.1 for local use, 0.0.0.0 for all interfaces)") from None
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def check_models(base_models: list[str], aliases: dict[str, str]) -> None:
    """Refuse, in one line each, any model that cannot load; reads only config.json files."""
    if not base_models:
        raise StartupError("no base model: pass --base-model ID_OR_DIR (or set TINSMITH_BASE_MODEL)")
    for name in base_models:
        check_model(name, "--base-model")
    for alias, target in aliases.items():
        if target not in base_models:
            check_model(target, f"--model-alias {alias}=")


def check_model(name: str, option: str) -> None:
    """Find ``name``'s config.json (local dir, HF cache, or just that file from the hub) and check
    that tinsmith runs its architecture."""
    config_file = _find_config(name, option)
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StartupError(f"{option} {name}: cannot read {config_file} ({e}); is this a Hugging Face model "
                           "directory?") from None
    from tinsmith.models.loading import read_config

    try:
        read_config(config_file.parent)
    except TinsmithError as e:
        raise StartupError(f"{option} {name}: {e.message}") from None
    except (KeyError, TypeError, ValueError) as e:
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        raise StartupError(f"{option} {name}: config.json of architecture {archs} lacks or mangles "
                           f"{e}; is it a complete Hugging Face config?") from None


def _find_config(name: str, option: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StartupError(f"{option} {name}: the directory has no config.json; point it at a Hugging Face "
                               "model directory (config.json + *.safetensors)")
        return path / "config.json"
    if path.exists():
        raise StartupError(f"{option} {name}: a file, not a model directory; point it at the directory that "
                           "holds config.json and the *.safetensors files")
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        raise StartupError(f"{option} {name}: no such directory, and not a Hugging Face hub id (ORG/NAME); "
                           "check the spelling")
    return _hub_config(name, option)


def _hub_config(repo_id: str, option: str) -> Path:
    """The config.json of a hub model: from the local cache, else fetched alone (kilobytes)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off"):
        raise StartupError(f"{option} {repo_id}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set; "
                           "download it first (huggingface-cli download) or pass a local directory")
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except GatedRepoError:
        raise StartupError(f"{option} {repo_id}: a gated model; accept its terms on huggingface.co and log in "
                           "(huggingface-cli login)") from None
    except RepositoryNotFoundError:
        raise StartupError(f"{option} {repo_id}: no such model on the Hugging Face hub (or it is private: "
                           "huggingface-cli login); check the spelling") from None
    except EntryNotFoundError:
        raise StartupError(f"{option} {repo_id}: the hub repository has no config.json; "
                           "is it a transformers model?") from None
    except LocalEntryNotFoundError:
        raise StartupError(f"{option} {repo_id}: not in the local Hugging Face cache and the hub cannot be "
                           "reached; download it first or pass a local directory") from None


def check_parallel(tensor_parallel_size: int, ray_address: str | None, data_parallel_size: int = 1) -> None:
    """Refuse parallel options that would do nothing: Ray places the ranks other than rank 0, and
    with one rank there are none (without this the option would be silently ignored)."""
    if ray_address is not None and tensor_parallel_size == 1 and data_parallel_size == 1:
        raise StartupError(f"--ray-address {ray_address} places the ranks of a tensor- or data-parallel group, but "
                           "--tensor-parallel-size and --data-parallel-size are 1 (one rank, in this process); pass "
                           "--tensor-parallel-size N or --data-parallel-size M (> 1) or drop --ray-address")


def check_precision(device: str, dtype: str) -> None:
    """Refuse a ``--device``/``--dtype`` pair that this machine's torch cannot compute with,
    by running each kind of op the model uses on tiny tensors (a second at most)."""
    import torch

    from tinsmith.models.loading import probe_dtype, resolve_dtype

    try:
        probe_dtype(torch.float32, device)
    except Exception as e:  # noqa: BLE001 - the device itself is unusable
        raise StartupError(f"--device {device} is not usable here: {_one_line(e)}; use cpu, or cuda / cuda:N "
                           "on a machine with a CUDA build of torch") from None
    torch_dtype = resolve_dtype(dtype, device)
    try:
        probe_dtype(torch_dtype, device)
    except Exception as e:  # noqa: BLE001 - any failure here means the pair cannot serve
        name = str(torch_dtype).removeprefix("torch.")
        raise StartupError(f"--dtype {dtype} ({name}) does not work on --device {device} with this torch "
                           f"({torch.__version__}): {_one_line(e)}; pick another --dtype (float32 works everywhere "
                           "torch runs)") from None


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
