"""benchmarks/bench_distill.py: the quick digits run writes its CSV and plot, and the issue's
targets are marked only where it set one."""
import pandas as pd
import pytest


def test_bench_distill_quick_digits_writes_its_csv_and_plot(tmp_path, load_script):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    bench = load_script("benchmarks/bench_distill.py")
    bench.main(["--only", "digits", "--quick", "--output-dir", str(tmp_path)])
    frame = pd.read_csv(tmp_path / "distill_digits.csv")
    assert frame["method"].tolist() == ["dense"] + ["global", "global+distill"] * len(bench.DIGITS_BUDGETS)
    distilled = frame[frame["method"] == "global+distill"]
    assert (distilled["loss_after"] <= distilled["loss_before"]).all() and (distilled["steps"] == 10).all()
    assert (tmp_path / "distill.png").stat().st_size > 1000


def test_bench_distill_marks_the_targets_of_a_ratio_without_an_out_of_domain_one(load_script):
    bench = load_script("benchmarks/bench_distill.py")
    frame = pd.DataFrame(dict(ratio=[0.3, 0.3], recipe=[bench.TARGET_RECIPE, "uniform"], in_domain=[0.85, 0.9],
                              out_of_domain=[0.6, 0.6]))
    marked = bench._with_targets(frame)
    assert marked["in_domain_target"].tolist()[0] == 0.8 and marked["in_domain_met"].tolist()[0]
    assert marked[["in_domain_met", "out_of_domain_target", "out_of_domain_met"]].isna().sum().tolist() == [1, 2, 2]
