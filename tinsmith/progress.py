"""Progress in the terminal for the long steps: loading a model, the demo, ``tinsmith export``.

Bars go to stderr, so stdout stays machine-readable (``export`` prints only the output path).
They are shown only when stderr is a terminal (and, where a command has one, no ``--quiet``):
logs and CI output should not fill up with carriage-return redraws.
"""

from __future__ import annotations

import sys
from typing import Any


def progress_wanted(quiet: bool = False) -> bool:
    """True when bars help: not ``--quiet`` and stderr is an interactive terminal."""
    return not quiet and sys.stderr.isatty()


def bar(enabled: bool, **kwargs: Any):
    """A ``tqdm`` bar on stderr (a disabled one, which costs nothing, when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, disable=not enabled, dynamic_ncols=True, **kwargs)


def progress_log(line: str) -> None:
    """Print a log line on stdout without breaking a bar drawn below it on the terminal."""
    if progress_wanted():
        from tqdm.auto import tqdm

        tqdm.write(line)
    else:
        print(line, flush=True)
