"""benchmarks/bench_moe_quality.py at tiny sizes: a dense row and one row per method and budget,
each converting the experts within its budget, and a plot."""
from __future__ import annotations

import pandas as pd
import pytest


def test_bench_moe_quality_converts_the_experts_at_every_budget_and_method(tmp_path, capsys, load_script):
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    bench = load_script("benchmarks/bench_moe_quality.py")
    argv = ["--hidden", "16", "--inter", "16", "--experts", "4", "--layers", "1", "--epochs", "1",
            "--budgets", "0.5", "0.25", "--output-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    df = pd.read_csv(tmp_path / "moe_quality_digits.csv")
    assert list(df["method"]) == ["dense"] + list(bench.METHODS) * 2
    converted = df[df["method"] != "dense"]
    assert (converted["stored_ratio"] <= converted["budget"] + 1e-9).all()
    assert df["accuracy"].between(0, 1).all() and (df["experts"] == 4).all()
    assert (tmp_path / "moe_quality_digits.png").stat().st_size > 1000
    assert capsys.readouterr().out.count("accuracy") == len(df)


def test_bench_moe_quality_rejects_a_budget_outside_0_1(load_script, capsys):
    bench = load_script("benchmarks/bench_moe_quality.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--budgets", "1.5"])
    assert "expected a budget in (0, 1]" in capsys.readouterr().err
