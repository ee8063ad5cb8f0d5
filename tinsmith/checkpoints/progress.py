"""Progress bars for the long steps of ``tinsmith export`` (merging, writing shards, uploading).

Bars go to stderr so stdout stays the one machine-readable line (the output path). They are
shown only when stderr is a terminal and the user did not ask for ``--quiet``: logs and CI
output should not fill up with carriage-return redraws.
"""

from __future__ import annotations

import sys
from typing import Any


def progress_wanted(quiet: bool) -> bool:
    """True when bars help: not ``--quiet`` and stderr is an interactive terminal."""
    return not quiet and sys.stderr.isatty()


def bar(enabled: bool, **kwargs: Any):
    """A ``tqdm`` bar on stderr (a disabled one, which costs nothing, when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, disable=not enabled, dynamic_ncols=True, **kwargs)
