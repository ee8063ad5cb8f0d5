"""``python -m tinsmith``: the same command line as the ``tinsmith`` script."""

import sys

from tinsmith.cli import main

sys.exit(main())
