"""The benchmark scripts: the sweep CLI checks its arguments before touching a file, writes
to the git-ignored benchmarks/out by default, keeps its rows when interrupted and never
leaves stale plots; the bar scripts report every bar with medians, spreads and repeats."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

from panther_lite.benchmark import BAR_COLUMNS, SWEEP_COLUMNS

TINY = ["--in-features", "24", "--out-features", "16", "--batch-size", "4", "--num-terms", "1", "2",
        "--low-rank", "2", "4", "--warmup", "0", "--repeats", "1", "--no-progress"]  # fmt: skip


def test_sweep_cli_runs_end_to_end_into_the_ignored_out_directory_by_default(tmp_path, repo_root, load_script, capsys):
    sweep = load_script("benchmarks/sweep.py")
    assert sweep.parse_args([]).output_dir == repo_root / "benchmarks" / "out" / "cpu"
    assert "benchmarks/out/" in (repo_root / ".gitignore").read_text().splitlines()
    # run a copy of the script, so that the checkout's own benchmarks/out is not touched
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(repo_root / "benchmarks" / "sweep.py", tmp_path / "benchmarks" / "sweep.py")
    copy = load_script(tmp_path / "benchmarks" / "sweep.py")
    assert copy.main([a for a in TINY if a != "--no-progress"]) == 0
    out = tmp_path / "benchmarks" / "out" / "cpu"
    df = pd.read_csv(out / "linear_float32.csv")
    assert list(df.columns) == list(SWEEP_COLUMNS) and len(df) == 5
    for name in ("linear_float32_heatmaps.png", "linear_float32_tradeoff.png"):
        assert (out / name).stat().st_size > 1000
    assert len(list(out.iterdir())) == 3  # no partial file left
    assert "sweep" in capsys.readouterr().err  # tqdm progress goes to stderr


def test_sweep_cli_builds_the_layer_case_asked_for(load_script):
    sweep = load_script("benchmarks/sweep.py")
    case = sweep.make_case(sweep.parse_args(["--layer", "conv2d", "--image-size", "9"]))
    assert (case.in_channels, case.out_channels, case.batch_size, case.image_size, case.kernel_size) == (64, 64, 8, 9, 3)
    assert sweep.parse_args(["--layer", "conv2d"]).num_terms == [1, 2, 4]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_default_output_is_ignored_by_git(repo_root):
    if not (repo_root / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", "benchmarks/out/cpu/linear_float32.csv"], cwd=repo_root)
    assert result.returncode == 0


@pytest.mark.parametrize("bad", [["--decay", "-1"], ["--decay", "nan"], ["--repeats", "0"], ["--seed", "-3"],
                                 ["--num-terms", "0"], ["--low-rank", "x"]])  # fmt: skip
def test_sweep_cli_rejects_bad_arguments_before_touching_previous_results(tmp_path, load_script, bad, capsys):
    sweep = load_script("benchmarks/sweep.py")
    previous = {name: f"previous {name}" for name in ("linear_float32.csv", "linear_float32_heatmaps.png")}
    for name, text in previous.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as exit_:
        sweep.main([*TINY, *bad, "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "expected" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == previous


def test_a_rerun_keeps_its_rows_when_interrupted_and_never_leaves_a_stale_plot(tmp_path, monkeypatch, capsys,
                                                                              load_script, quick_plots):
    sweep = load_script("benchmarks/sweep.py")
    csv_path = tmp_path / "linear_float32.csv"
    plots = [tmp_path / "linear_float32_heatmaps.png", tmp_path / "linear_float32_tradeoff.png"]
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 0
    assert all(p.exists() for p in plots) and capsys.readouterr().out.count("wrote") == 3
    # interrupted after three rows: they replace the CSV, and the plots are redrawn from them
    interrupt_after(sweep, monkeypatch, rows=3)
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 130
    assert pd.read_csv(csv_path)["method"].tolist() == ["dense", "sketched", "sketched"]
    out, err = capsys.readouterr()
    assert out.count("replaced") == 2 and "interrupted: the 3 rows" in err
    # interrupted after the dense row only: nothing to plot, so the previous plots go, and it says so
    interrupt_after(sweep, monkeypatch, rows=1)
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 130
    assert len(pd.read_csv(csv_path)) == 1 and not any(p.exists() for p in plots)
    assert capsys.readouterr().out.count("removed") == 2
    # interrupted before the first row: everything is left as it was
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    interrupt_after(sweep, monkeypatch, rows=0)
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 130
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert "left as it was" in capsys.readouterr().err


def interrupt_after(sweep, monkeypatch, rows: int) -> None:
    """Make the script's ``run_sweep`` raise KeyboardInterrupt once ``rows`` rows are written."""
    real_run_sweep = sweep.run_sweep

    def interrupted(*args, on_row, **kwargs):
        seen = []

        def count(row):
            on_row(row)
            seen.append(row)
            if len(seen) == rows:
                raise KeyboardInterrupt

        if rows == 0:
            raise KeyboardInterrupt
        return real_run_sweep(*args, on_row=count, **kwargs)

    monkeypatch.setattr(sweep, "run_sweep", interrupted)


def check_bars(df: pd.DataFrame, repeats: int) -> None:
    assert list(df.columns) == list(BAR_COLUMNS)
    assert (df["repeats"] == repeats).all() and (df["measured_iqr"] >= 0).all() and (df["measured"] > 0).all()
    assert (df["passed"] == (df["measured"] >= df["required"])).all()


def test_bench_sklinear_reports_every_cpu_bar(tmp_path, capsys, load_script):
    bench = load_script("benchmarks/bench_sklinear.py")
    args = ["--features", "64", "--batch", "8", "--warmup", "0", "--repeats", "2", "--output-dir", str(tmp_path)]
    assert bench.main(args) == 0
    df = pd.read_csv(tmp_path / "sklinear_bars.csv")
    check_bars(df, repeats=2)
    assert df["reference"].tolist() == ["nn.Linear", "anchor", "nn.Linear"]
    assert df["mode"].tolist() == ["forward", "forward", "forward+backward"]
    flop_ratio = {1: 64 * 64 / (2 * 64 * 128), 2: 64 * 64 / (2 * 128 * 128)}
    assert df["required"].tolist() == pytest.approx([0.7 * flop_ratio[1], 2.0, 0.6 * flop_ratio[2]])
    assert (tmp_path / "sklinear_bars.png").stat().st_size > 1000
    assert capsys.readouterr().out.count("required") == 3


def test_bench_sklinear_draws_the_dense_layer_on_the_cpu(monkeypatch, load_script):
    """Seeded on the CPU (the same layer on every device), not by reseeding CUDA's generators."""
    import torch

    bench = load_script("benchmarks/bench_sklinear.py")
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    first, second = (bench.Bench("cpu", torch.float32, 16, 2, 0, 1) for _ in range(2))
    assert reseeded == []
    assert torch.equal(first.dense.weight, second.dense.weight)


def test_bench_host_overhead_reports_both_bars_in_both_modes(tmp_path, capsys, load_script):
    bench = load_script("benchmarks/bench_host_overhead.py")
    assert bench.main(["--warmup", "1", "--repeats", "3", "--output-dir", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "host_overhead.csv")
    check_bars(df, repeats=3)
    assert df["mode"].tolist() == ["inference_mode", "no_grad"] * 3
    flop_ratio = {k: (768 * 3072) / (2 * k * (768 + 3072)) for k in (96, 192)}  # ranks 2Lk = 192 and 384
    np.testing.assert_allclose(df["required"], [0.5, 0.5, *[0.8 * flop_ratio[96]] * 2, *[0.8 * flop_ratio[192]] * 2])
    assert (tmp_path / "host_overhead.png").stat().st_size > 1000
    assert capsys.readouterr().out.count("required") == 6


def test_bench_skconv2d_times_dense_sketched_and_anchor(tmp_path, capsys, load_script):
    bench = load_script("benchmarks/bench_skconv2d.py")
    assert bench.main(["--kernels", "3", "--images", "6", "--channels", "4", "--warmup", "0", "--repeats", "2",
                       "--output-dir", str(tmp_path)]) == 0  # fmt: skip
    df = pd.read_csv(tmp_path / "skconv2d_float32.csv")
    assert len(df) == 4 and set(df["mode"]) == set(bench.MODES)
    assert (df["repeats"] == 2).all() and (df["speedup_iqr"] >= 0).all()
    assert capsys.readouterr().out.count("anchor/SK") == 2
    forward = df[df["mode"] == "forward"]
    assert (forward["anchor_speedup"] > 0).all() and df[df["mode"] != "forward"]["anchor_ms"].isna().all()
    np.testing.assert_allclose(df["flop_ratio"], (4 * 9 * 4) / (2 * 4 * (4 * 9 + 4)))
    assert (tmp_path / "skconv2d_float32.png").stat().st_size > 1000


def test_sweep_cli_refuses_a_csv_path_that_is_a_directory_before_running(tmp_path, load_script, capsys, monkeypatch):
    sweep = load_script("benchmarks/sweep.py")
    (tmp_path / "linear_float32.csv").mkdir()
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    with pytest.raises(SystemExit) as exit_:
        sweep.main([*TINY, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "linear_float32.csv" in err and "is a directory" in err


@pytest.mark.parametrize("second_interrupt_at", [0, 1])
def test_a_second_ctrl_c_while_plotting_never_leaves_another_runs_plots(tmp_path, monkeypatch, load_script, quick_plots,
                                                                          second_interrupt_at):
    """The rows are measured; then Ctrl-C while the plots are drawn: whatever was published, no
    plot beside the CSV shows another run than the CSV's."""
    from panther_lite.benchmark import plots

    sweep = load_script("benchmarks/sweep.py")
    csv_path = tmp_path / "linear_float32.csv"
    plot_paths = [tmp_path / "linear_float32_heatmaps.png", tmp_path / "linear_float32_tradeoff.png"]
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 0
    old_csv, old_plots = csv_path.read_bytes(), {p: p.read_bytes() for p in plot_paths}
    draw = plots.plot_heatmaps
    calls = []

    def interrupted(df, path):
        calls.append(path)
        if len(calls) > second_interrupt_at:
            raise KeyboardInterrupt
        return draw(df, path)

    monkeypatch.setattr(plots, "plot_heatmaps", interrupted)
    monkeypatch.setattr(plots, "plot_tradeoff", interrupted)
    interrupt_after(sweep, monkeypatch, rows=3)  # the first Ctrl-C: 3 rows measured
    assert sweep.main([*TINY, "--output-dir", str(tmp_path)]) == 130
    assert len(pd.read_csv(csv_path)) == 3 or csv_path.read_bytes() == old_csv
    if csv_path.read_bytes() != old_csv:
        assert not any(p.exists() and p.read_bytes() == old_plots[p] for p in plot_paths)
    assert sorted(p.name for p in tmp_path.iterdir()) <= sorted([csv_path.name, *(p.name for p in plot_paths)])


def test_bench_command_times_each_recipe_and_scores_the_written_model(tmp_path, load_script, save_checkpoint,
                                                                       word_tokenizer, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=len(word_tokenizer()), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model_dir = save_checkpoint(transformers.BertModel(config).eval(), tmp_path / "bert")
    bench = load_script("benchmarks/bench_command.py")
    frame = bench.main(["--model-dir", str(model_dir), "--quick", "--output-dir", str(tmp_path / "out")])
    written = pd.read_csv(tmp_path / "out" / "command_minilm.csv")
    assert list(written["recipe"]) == list(bench.RECIPES) == list(frame["recipe"])
    assert list(written["options"].fillna("")) == ["", "--allocation global --random-tokens 16"]
    assert (written["seconds"] > 0).all() and written["mean_cosine"].between(-1, 1.0001).all()
    assert (written["min_cosine"] <= written["mean_cosine"]).all()
