"""Result CSVs: rows flushed as written, the previous CSV replaced only when a run ends,
and kept when a run fails or is interrupted before its first row."""
from __future__ import annotations

import pandas as pd
import pytest

from panther_lite.benchmark import CsvRows
from panther_lite.benchmark.records import partial_path

COLUMNS = ["a", "b"]


def write_previous(path):
    path.write_text("a,b\nold,old\n")


def test_rows_are_flushed_to_the_partial_file_and_moved_into_place(tmp_path):
    path = tmp_path / "out" / "r.csv"
    with CsvRows(path, COLUMNS) as rows:
        rows.write({"a": 1, "b": float("nan")})
        assert pd.read_csv(partial_path(path)).shape == (1, 2)  # already on disk
        assert not path.exists()
    assert not partial_path(path).exists()
    assert pd.read_csv(path)["a"].tolist() == [1] and pd.read_csv(path)["b"].isna().all()


def test_an_interrupted_run_replaces_the_previous_csv_with_its_rows(tmp_path):
    path = tmp_path / "r.csv"
    write_previous(path)
    with pytest.raises(KeyboardInterrupt):
        with CsvRows(path, COLUMNS) as rows:
            rows.write({"a": 1, "b": 2})
            raise KeyboardInterrupt
    assert pd.read_csv(path).to_dict("records") == [{"a": 1, "b": 2}]


def test_a_run_interrupted_before_its_first_row_leaves_the_previous_csv(tmp_path):
    path = tmp_path / "r.csv"
    write_previous(path)
    with pytest.raises(KeyboardInterrupt):
        with CsvRows(path, COLUMNS):
            raise KeyboardInterrupt
    assert path.read_text() == "a,b\nold,old\n" and not partial_path(path).exists()


def test_a_failed_run_leaves_the_previous_csv_and_names_its_partial_rows(tmp_path):
    path = tmp_path / "r.csv"
    write_previous(path)
    with pytest.raises(RuntimeError) as failure:
        with CsvRows(path, COLUMNS) as rows:
            rows.write({"a": 1, "b": 2})
            raise RuntimeError("out of memory")
    assert path.read_text() == "a,b\nold,old\n"
    assert len(pd.read_csv(partial_path(path))) == 1
    assert str(partial_path(path)) in "".join(failure.value.__notes__)


def test_without_a_path_nothing_is_written(tmp_path):
    with CsvRows(None, COLUMNS) as rows:
        rows.write({"a": 1})
    assert rows.rows_written == 1 and not any(tmp_path.iterdir())
