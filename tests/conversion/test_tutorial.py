"""The compress_model tutorial runs at tiny sizes and writes its table and plot."""
from __future__ import annotations

import importlib.util

import pandas as pd


def test_compress_model_tutorial_runs_quick(tmp_path, repo_root):
    spec = importlib.util.spec_from_file_location("compress_model", repo_root / "tutorials" / "compress_model.py")
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    table = tutorial.main(["--quick", "--output-dir", str(tmp_path)])
    assert (tmp_path / "compress_model_digits.png").stat().st_size > 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "compress_model_digits.csv"), table)
    assert set(table["init"]) == {"sketch", "svd", "calibrated"}
