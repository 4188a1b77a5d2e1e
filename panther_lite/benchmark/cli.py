"""Command-line helpers shared by the benchmark scripts: the argument types of
:mod:`panther_lite.cli.arguments` (one definition for the command and the scripts)."""
from ..cli.arguments import DTYPES, non_negative_float, non_negative_int, positive_float, positive_int

__all__ = ["DTYPES", "positive_int", "non_negative_int", "non_negative_float", "positive_float"]
