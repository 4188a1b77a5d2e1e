"""benchmarks/bench_llm_ppl.py: its splits never share text, and a quick run (a tiny random LLaMA)
writes one row per method and ratio with perplexities, time and peak memory, and the plot."""
import pandas as pd
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def test_validation_and_test_docstrings_come_from_disjoint_modules(load_script):
    bench = load_script("benchmarks/bench_llm_ppl.py")
    validation, test = (set(bench.DOCSTRING_MODULES[split].split()) for split in ("validation", "test"))
    assert not validation & test and "pydoc_data" not in validation | test
    assert not set(bench.docstrings(" ".join(validation)).split("\n\n")) & set(bench.docstrings(" ".join(test)).split("\n\n"))


def test_quick_run_measures_every_method_against_dense(load_script, tmp_path):
    bench = load_script("benchmarks/bench_llm_ppl.py")
    bench.main(["--quick", "--ratios", "0.5", "--eval-windows", "2", "--output-dir", str(tmp_path)])
    frame = pd.read_csv(tmp_path / "llm_ppl_quick.csv")
    assert list(frame["method"]) == ["dense", "SVD-LLM", *bench.RECIPES]
    measured = frame[frame["method"] != "dense"]
    assert (measured["param_ratio"] == 0.5).all() and (measured["seconds"] > 0).all() and (measured["peak_gb"] > 0).all()
    assert (frame[["like calibration", "other prose", "docstrings"]] > 1).all().all()
    assert (tmp_path / "llm_ppl_quick.png").stat().st_size > 0


def test_merge_keeps_the_earlier_rows_it_does_not_measure_again(load_script, tmp_path):
    bench = load_script("benchmarks/bench_llm_ppl.py")
    earlier = pd.DataFrame([dict(method=m, param_ratio=r, docstrings=v) for m, r, v in
                            [("dense", 1.0, 1.0), ("SVD-LLM", 0.8, 9.0), ("--recipe causal-lm", 0.8, 5.0),
                             ("SVD-LLM", 0.6, 20.0)]])
    earlier.to_csv(tmp_path / "earlier.csv", index=False)
    new = pd.DataFrame([dict(method="dense", param_ratio=1.0, docstrings=1.0),
                        dict(method="--recipe causal-lm", param_ratio=0.8, docstrings=2.0)])
    frame = bench.merged(tmp_path / "earlier.csv", new)
    assert list(zip(frame["method"], frame["param_ratio"], frame["docstrings"])) == [
        ("dense", 1.0, 1.0), ("SVD-LLM", 0.8, 9.0), ("--recipe causal-lm", 0.8, 2.0), ("SVD-LLM", 0.6, 20.0)]
    assert bench.merged(tmp_path / "absent.csv", new) is new
