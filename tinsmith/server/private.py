"""The server's files are private to the user it runs as: directories 0700, files 0600.

Checkpoints hold users' weights, the database holds their requests and results, and the data
dir holds the secret that signs download links. ``tinsmith serve`` sets the process umask to
``PRIVATE_UMASK`` before it writes anything, so every file and directory it creates (SQLite
and its -wal/-shm files, checkpoint files and directories, the lock file) is born private;
:func:`make_private` tightens what an earlier run left open to group or others.

Only the server is affected: ``tinsmith export`` writes with the caller's own umask, and
downloads are served by the server process, which owns the files.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
_OPEN = 0o077  # group and other permission bits
SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")
DATA_DIR_FILES = ("server-secret", "tinsmith.lock")


def set_private_umask() -> None:
    """Every file and directory this process creates from now on is private."""
    os.umask(PRIVATE_UMASK)


def make_private(data_dir: str | Path, checkpoint_dir: str | Path, sqlite_path: str | Path | None) -> int:
    """Create the data and checkpoint dirs private, and take group/other access away from
    what already exists: the data dir, its server files, the SQLite database with its
    companions, and the whole checkpoint tree. Returns how many modes changed.

    Only what the server owns is touched: other entries of the data dir (and the parent of a
    SQLite file outside it) are left as they are.
    """
    data_dir, checkpoint_dir = Path(data_dir).resolve(), Path(checkpoint_dir).resolve()
    for d in (data_dir, checkpoint_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = [data_dir, *(data_dir / f for f in DATA_DIR_FILES)]
    if sqlite_path is not None:
        paths += [Path(f"{sqlite_path}{suffix}") for suffix in SQLITE_COMPANIONS]
    changed = sum(_tighten(p) for p in paths)
    for parent, dirs, files in os.walk(checkpoint_dir):
        changed += _tighten(Path(parent))
        changed += sum(_tighten(Path(parent) / f) for f in files)
    if changed:
        log.info("made %d file(s) and director(ies) of the data dir and checkpoints private to their owner", changed)
    return changed


def _tighten(path: Path) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & _OPEN:
        return False
    try:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~_OPEN)
    except PermissionError as e:  # not ours (created by another user): say so, do not stop
        log.warning("could not make %s private: %s", path, e)
        return False
    return True
