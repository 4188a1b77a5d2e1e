"""Result files: rows with fixed columns written to a CSV as they are measured, without
ever leaving a half-written file in the CSV's place."""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Union


def partial_path(path: Union[str, Path]) -> Path:
    """Where the rows of a run bound for ``path`` are written meanwhile: ``<path>.partial``."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


class CsvRows:
    """Writes rows with fixed ``columns`` to the CSV at ``path`` (nothing when None).

    Rows go to :func:`partial_path` and are flushed one by one, so a run that is killed
    keeps every row it finished there. Used as a context manager, the partial file is
    moved over ``path`` (an atomic rename) when the run ends normally or is interrupted
    (``KeyboardInterrupt``) after writing rows: the CSV always holds one run's rows, and a
    previous CSV is untouched until then. A run interrupted before its first row leaves
    the previous CSV alone; one that fails with an error leaves it alone too and keeps
    its finished rows in the partial file, which the error's notes name.
    """

    def __init__(self, path: Optional[Union[str, Path]], columns: Sequence[str]) -> None:
        self.path = None if path is None else Path(path)
        self.columns = list(columns)
        self.rows_written = 0
        self._file = None

    def __enter__(self) -> "CsvRows":
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(partial_path(self.path), "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
            self._writer.writeheader()
            self._file.flush()
        return self

    def write(self, row: Dict[str, object]) -> None:
        """Append ``row`` (missing or NaN values as empty cells) and flush it to disk."""
        if self._file is not None:
            self._writer.writerow({c: "" if _missing(row.get(c)) else row.get(c) for c in self.columns})
            self._file.flush()
        self.rows_written += 1

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self._file is None:
            return
        self._file.close()
        partial = partial_path(self.path)
        if exc_type is None or (issubclass(exc_type, KeyboardInterrupt) and self.rows_written):
            os.replace(partial, self.path)
        elif issubclass(exc_type, KeyboardInterrupt):
            partial.unlink()
        else:
            exc.add_note(f"the {self.rows_written} rows finished are in {partial}; {self.path} was left as it was")


def write_table_and_figure(frame, stem: Union[str, Path], plot: Callable[[object, Path], None]) -> None:
    """Write a benchmark's rows to ``<stem>.csv`` and ``plot(frame, <stem>.png)`` (the folder
    created as needed), and say so on stdout."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    plot(frame, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv and {stem}.png")


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
