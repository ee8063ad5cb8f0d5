"""Progress in the terminal: a bar on stderr when it is a terminal, plain lines otherwise."""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str):
    """A progress bar on stderr when it is a terminal (log lines then go above it); inert otherwise."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, disable=not sys.stderr.isatty())


def progress_log(line: str) -> None:
    """Print a log line without breaking a progress bar drawn below it."""
    from tqdm.auto import tqdm

    if sys.stderr.isatty():
        tqdm.write(line)
    else:
        print(line, flush=True)
