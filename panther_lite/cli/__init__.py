"""The ``python -m panther_lite`` command line (also installed as ``panther-lite``): its
sub-commands and their entry point."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..version import __version__
from .checkpoint import CommandError
from .compress import add_compress_command
from .recipes import expand_recipe
from .signals import TERMINATED, Terminated, sigterm_raises

__all__ = ["main", "build_parser", "CommandError"]

PROG = "python -m panther_lite"
SCRIPT = "panther-lite"  # the console script of pyproject.toml
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
# what bad input raises; anything else is a bug and keeps its traceback
_INPUT_ERRORS = (CommandError, ValueError, TypeError, OSError, RuntimeError, ImportError)


def _input_errors() -> tuple:
    """:data:`_INPUT_ERRORS` and safetensors' own error (a truncated or corrupt file), when loaded."""
    safetensors = sys.modules.get("safetensors")
    return _INPUT_ERRORS + ((safetensors.SafetensorError,) if hasattr(safetensors, "SafetensorError") else ())


def _prog() -> str:
    """How the user called us: the console script's name, else ``python -m panther_lite``."""
    return SCRIPT if os.path.basename(sys.argv[0] if sys.argv else "").startswith(SCRIPT) else PROG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_prog(), description="panther_lite commands")
    parser.add_argument("--version", action="version", version=f"panther_lite {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_compress_command(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run a command (``argv`` without the program name; None: ``sys.argv[1:]``) and return
    its exit status (a ``--recipe`` expanded into its options first): 0 on success, 1 with one line on stderr for bad input or a failed
    conversion, 2 for bad options (argparse's usage message), 130 on Ctrl-C, 143 on SIGTERM
    (both clean up as a failure does)."""
    parser = build_parser()
    try:
        args = parser.parse_args(expand_recipe(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_request:  # --help, or argparse rejected an option
        return exit_request.code if isinstance(exit_request.code, int) else 2
    try:
        with sigterm_raises():
            return args.run(args)
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; nothing was written to OUT_DIR", file=sys.stderr)
        return INTERRUPTED
    except Terminated:
        print(f"{parser.prog} {args.command}: terminated (SIGTERM); nothing was written to OUT_DIR", file=sys.stderr)
        return TERMINATED
    except _input_errors() as error:
        one_line = " ".join(str(error).split()) or (  # library messages may span lines; never print nothing
            f"{type(error).__name__} without a message (a bug in panther_lite: please report it with this command)")
        print(f"{parser.prog} {args.command}: error: {one_line}", file=sys.stderr)
        return 1
