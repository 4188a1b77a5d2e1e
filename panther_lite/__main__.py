"""``python -m panther_lite``: the command line (see :mod:`panther_lite.cli`)."""
import sys

from .cli import main

sys.exit(main())
