"""An output directory written all at once, never at its inputs' expense: files go to a staging
directory beside it (same filesystem, ``.<name>.partial``), renamed into place at the end; on
any failure, Ctrl-C or SIGTERM it is removed, unless it holds finished work a later run can
resume from (then it stays, and only a run asked to resume may use it); a directory that is,
holds or lies inside an input is refused before anything is created, however the paths are
spelled (links, ``..``, relative)."""
from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
import shutil
from pathlib import Path
from typing import Iterator, List, Mapping, Optional, Tuple

__all__ = ["check_output_dir", "staged_directory", "is_within", "Staging", "staging_path"]

Inputs = Mapping[str, Path]  # what the message calls each input ("MODEL_DIR") -> its path


def _identity(path: Path) -> Optional[Tuple[int, int]]:
    """``(device, inode)`` of ``path`` (links followed), None when it does not exist."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def is_within(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it, judged where the filesystem puts them:
    links followed, ``..`` and relative spellings resolved, and an existing ``outer`` found by
    its identity (so a bind mount or a case-insensitive spelling of it counts too)."""
    real = Path(os.path.realpath(inner))
    target = _identity(outer)
    if target is None:
        outer_real = Path(os.path.realpath(outer))
        return real == outer_real or outer_real in real.parents
    return any(_identity(place) == target for place in (real, *real.parents))


def _input_places(path: Path) -> Iterator[Path]:
    """``path`` and, for a directory, every entry under it: a linked file (a Hugging Face cache
    snapshot links each file to a blob elsewhere) is part of the input wherever it points."""
    yield path
    if path.is_dir():
        for root, folders, files in os.walk(path):  # linked folders are not entered, only checked
            yield from (Path(root, name) for name in sorted((*folders, *files)))


def _check_inputs_kept(output: Path, spelled: str, inputs: Inputs) -> None:
    for label, path in inputs.items():
        if path.is_dir() and is_within(output, path):
            raise ValueError(f"OUT_DIR {spelled!r} is {label} or inside it: choose a directory outside {label}")
        held = next((place for place in _input_places(path) if is_within(place, output)), None)
        if held is not None:
            what = label if held == path else f"{label}'s {str(held.relative_to(path))!r}"
            raise ValueError(
                f"OUT_DIR {spelled!r} holds {what} ({str(path)!r}): writing OUT_DIR would replace the input; "
                "choose a directory that does not contain it"
            )


def check_output_dir(output: Path, overwrite: bool, inputs: Optional[Inputs] = None) -> None:
    """Raise ValueError when ``output`` is, holds or lies inside one of ``inputs`` (whatever
    ``overwrite`` says), is a file or inside one, or is a non-empty directory and ``overwrite``
    is False."""
    spelled = str(output)
    _check_inputs_kept(output, spelled, inputs or {})
    if output.exists() and not output.is_dir():
        raise ValueError(f"OUT_DIR {spelled!r} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ValueError(f"OUT_DIR {spelled!r} exists and is not empty: pass --overwrite (overwrite=True) to replace it")
    parents = Path(os.path.abspath(output)).parents
    blocking = next((path for path in parents if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"OUT_DIR {spelled!r} is inside {str(blocking)!r}, a file")


def _missing_ancestors(directory: Path) -> List[Path]:
    """The ancestors of ``directory`` (itself included) that do not exist, deepest first."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _new_directory(parent: Path, prefix: str) -> Path:
    """A new empty directory ``parent/<prefix><random>``, with the mode the umask gives any new
    directory (``tempfile.mkdtemp`` would make it private: ``drwx------`` whatever the umask)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _move_into_place(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``; a directory already at ``output`` is set aside first
    and put back if the rename fails, then removed."""
    if not output.exists():
        os.rename(staging, output)
        return
    aside = _new_directory(output.parent, f".{output.name}.replaced-")
    os.rename(output, aside / output.name)
    try:
        os.rename(staging, output)
    except BaseException:
        os.rename(aside / output.name, output)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def staging_path(output: Path) -> Path:
    """The staging directory of ``output``: ``.<name>.partial`` beside where ``output`` really is."""
    real = Path(os.path.realpath(output))
    return real.parent / f".{real.name}.partial"


@dataclass
class Staging:
    """The staging directory a run writes into (``path``); ``keep`` (set by the run once the
    directory holds work a later run can resume from) keeps it after a failure."""

    path: Path
    keep: bool = False


@contextlib.contextmanager
def staged_directory(
    output: Path, overwrite: bool = False, inputs: Optional[Inputs] = None, resume: bool = False
) -> Iterator[Staging]:
    """Yield the :class:`Staging` directory of ``output`` (:func:`staging_path`); when the block
    ends normally it becomes ``output`` (replacing it if ``overwrite``). On failure it is removed,
    with any parent directories made for it, unless its ``keep`` was set; ``output`` is left as it
    was either way. An existing staging directory (an earlier run's, kept) is used only with
    ``resume``; without, it is a ValueError saying so.

    ``output`` is checked with :func:`check_output_dir` (``inputs`` included) before anything
    is made and again before it is replaced. A linked ``output`` is written where the link
    points; the staging directory and ``output`` get the umask's permissions."""
    check_output_dir(output, overwrite, inputs)
    real, path = Path(os.path.realpath(output)), staging_path(output)
    if path.exists() and not resume:
        raise ValueError(
            f"{str(path)!r} holds an unfinished run for OUT_DIR {str(output)!r}: pass resume=True (--resume) to "
            "continue it, or delete it to start again"
        )
    made = _missing_ancestors(real.parent)
    staging = Staging(path, keep=path.exists())
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
        check_output_dir(output, overwrite, inputs)  # something may have been written there meanwhile
        _move_into_place(path, real)
    except BaseException:
        if not staging.keep:
            shutil.rmtree(path, ignore_errors=True)
            for directory in made:
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
