"""An output directory written all at once: files go to a staging directory beside it (same
filesystem), which is renamed into place at the end and removed on any failure or Ctrl-C."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, List

from .checkpoint import CommandError

__all__ = ["check_output_dir", "staged_directory"]


def check_output_dir(output: Path, overwrite: bool) -> None:
    """Raise :class:`~panther_lite.cli.checkpoint.CommandError` when ``output`` is a file, or a
    non-empty directory and ``overwrite`` is False."""
    if output.exists() and not output.is_dir():
        raise CommandError(f"OUT_DIR {str(output)!r} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise CommandError(f"OUT_DIR {str(output)!r} exists and is not empty: pass --overwrite to replace it")
    blocking = next((path for path in output.parents if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        raise CommandError(f"OUT_DIR {str(output)!r} is inside {str(blocking)!r}, a file")


def _missing_ancestors(directory: Path) -> List[Path]:
    """The ancestors of ``directory`` (itself included) that do not exist, deepest first."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _move_into_place(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``; a directory already at ``output`` is set aside first
    and put back if the rename fails, then removed."""
    if not output.exists():
        os.rename(staging, output)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{output.name}.replaced-", dir=output.parent))
    os.rename(output, aside / output.name)
    try:
        os.rename(staging, output)
    except BaseException:
        os.rename(aside / output.name, output)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory beside ``output``; when the block ends normally it
    becomes ``output`` (replacing it if ``overwrite``), otherwise it is removed, with any
    parent directories made for it, and ``output`` is left as it was.

    Checks ``output`` with :func:`check_output_dir` first."""
    output = Path(os.path.abspath(output))
    check_output_dir(output, overwrite)
    made = _missing_ancestors(output.parent)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
        check_output_dir(output, overwrite)  # something may have been written there meanwhile
        _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
