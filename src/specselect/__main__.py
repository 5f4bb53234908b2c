"""``python -m specselect``: the command line (see :mod:`specselect.cli`)."""

import sys

from specselect.cli import main

sys.exit(main())
