"""The measurement library, the sweep CLI, the SKLinear bars script and the
parameter-sweep tutorial: helpers measure what they claim on known cases, sweeps write
every column, plots and keep their rows when interrupted."""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.benchmark import (
    SWEEP_COLUMNS,
    Conv2dCase,
    DevicePeaks,
    LinearCase,
    anchor_conv2d,
    anchor_linear,
    digits_task_accuracy,
    measure_device_peaks,
    parameter_bytes,
    pareto_front,
    plot_heatmaps,
    plot_tradeoff,
    roofline_ms,
    run_sweep,
    saved_activation_bytes,
    structured_weight,
    time_callable,
    training_memory_bytes,
)
from panther_lite.nn import SKConv2d, SKLinear

ROOT = Path(__file__).resolve().parents[1]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def load_script(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_sweep(tmp_path, **kwargs) -> pd.DataFrame:
    options = dict(warmup=0, repeats=1, progress=False, csv_path=tmp_path / "sweep.csv")
    options.update(kwargs)
    return run_sweep(LinearCase(24, 16, 4), [1, 2], [2, 4], **options)


# ------------------------------------------------------------------ timing


def test_time_callable_runs_warmup_plus_repeats_and_returns_the_median():
    durations = iter([0.0, 0.001, 0.001, 0.05])  # one warm-up, then 1 ms, 1 ms and one 50 ms outlier
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(durations))

    ms = time_callable(fn, warmup=1, repeats=3)
    assert len(calls) == 4
    assert 1.0 <= ms < 25.0  # the median ignores the outlier that a mean would include


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(warmup=-1), "warmup"), (dict(repeats=0), "repeats"), (dict(repeats=2.5), "repeats"),
     (dict(device="meta"), "CPU or CUDA")],
)
def test_time_callable_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_callable(lambda: None, **kwargs)


@requires_cuda
def test_time_callable_on_cuda_measures_gpu_work():
    a = torch.randn(2048, 2048, device="cuda")
    small = time_callable(lambda: a[:128, :128] @ a[:128, :128], device="cuda", warmup=2, repeats=5)
    large = time_callable(lambda: a @ a, device="cuda", warmup=2, repeats=5)
    assert 0 < small < large


@requires_cuda
@pytest.mark.parametrize("flush_cache", [True, False])
def test_time_callable_on_cuda_flushes_a_buffer_larger_than_l2(flush_cache):
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    time_callable(lambda: None, device="cuda", warmup=0, repeats=2, flush_cache=flush_cache)
    scratch = torch.cuda.max_memory_allocated() - before
    assert (scratch > l2_bytes) if flush_cache else (scratch == 0)


# ------------------------------------------------------------------ memory


def test_parameter_bytes_counts_parameters_and_buffers_once_per_storage():
    linear = nn.Linear(10, 7)
    assert parameter_bytes(linear) == (70 + 7) * 4
    norm = nn.BatchNorm1d(5, dtype=torch.float64)  # weight, bias, running mean/var: 8 bytes each; count: int64
    assert parameter_bytes(norm) == 4 * 5 * 8 + 8
    tied = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    tied[1].weight = tied[0].weight
    assert parameter_bytes(tied) == 36 * 4
    layer = SKLinear(40, 30, 2, 3, seed=0)
    assert parameter_bytes(layer) == 4 * layer.parameter_counts().stored


def test_saved_activation_bytes_of_known_ops():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert saved_activation_bytes(lambda: torch.exp(x)) == 15 * 8  # exp saves its output
    assert saved_activation_bytes(lambda: x * x) == 15 * 8  # x saved twice, one storage
    assert saved_activation_bytes(lambda: x.t() * x.t()) == 15 * 8  # views share x's storage
    assert saved_activation_bytes(lambda: x.sum()) == 0
    assert saved_activation_bytes(lambda: torch.exp(x), exclude=[x.detach()]) == 15 * 8
    assert saved_activation_bytes(lambda: x * 2.0 * x, exclude=[x]) == 15 * 8  # only x*2.0 counts
    with torch.no_grad():
        assert saved_activation_bytes(lambda: torch.exp(x)) == 0


def test_saved_activation_bytes_of_dense_and_sketched_linear():
    x = torch.randn(6, 10, requires_grad=True)
    dense = nn.Linear(10, 7)
    assert saved_activation_bytes(lambda: dense(x), list(dense.parameters())) == x.numel() * 4
    layer = SKLinear(10, 7, 1, 2, seed=0)
    tensors = list(layer.parameters()) + list(layer.buffers())
    # x and the batch × Lk activation x·U2; the factors and sketches are excluded
    assert saved_activation_bytes(lambda: layer(x), tensors) == (6 * 10 + 6 * 2) * 4
    assert training_memory_bytes(layer, x) == parameter_bytes(layer) + (6 * 10 + 6 * 2) * 4


def test_anchor_formulation_saves_per_term_outputs():
    """The per-term formulation keeps L-sized temporaries that the layer avoids."""
    layer = SKLinear(32, 32, 4, 2, seed=0)
    x = torch.randn(8, 32, requires_grad=True)
    tensors = list(layer.parameters()) + list(layer.buffers())
    sketched = saved_activation_bytes(lambda: layer(x), tensors)
    per_term = saved_activation_bytes(lambda: anchor_linear(layer)(x), tensors)
    assert per_term > sketched


@requires_cuda
def test_training_memory_on_cuda_includes_parameters_and_activations():
    layer = nn.Linear(256, 256, device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    assert training_memory_bytes(layer, x) >= parameter_bytes(layer) + 128 * 256 * 4


# ------------------------------------------------------------------ accuracy


def test_structured_weight_has_the_decaying_spectrum_and_linear_init_norm():
    weight = structured_weight(40, 30, decay=1.0, seed=3, dtype=torch.float64)
    assert weight.shape == (40, 30)
    sigma = torch.linalg.svdvals(weight)
    torch.testing.assert_close(sigma / sigma[0], 1.0 / torch.arange(1, 31, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.norm() ** 2, torch.tensor(40 / 3, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(weight, structured_weight(40, 30, seed=3, dtype=torch.float64), rtol=0, atol=0)
    assert not torch.equal(weight, structured_weight(40, 30, seed=4, dtype=torch.float64))
    with pytest.raises(ValueError, match="decay"):
        structured_weight(4, 4, decay=-1.0)


def test_anchor_linear_equals_the_layer_in_float64():
    layer = SKLinear(40, 33, num_terms=3, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(7, 40, dtype=torch.float64)
    torch.testing.assert_close(anchor_linear(layer)(x), layer(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="batch, in"):
        anchor_linear(layer)(x[None])


def test_anchor_conv2d_equals_the_layer_in_float64():
    layer = SKConv2d(8, 16, 3, stride=2, padding=1, num_terms=2, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(anchor_conv2d(layer)(x), layer(x), rtol=1e-12, atol=1e-12)


def test_digits_task_accuracy_learns_and_is_reproducible():
    dense = digits_task_accuracy("linear", width=32, epochs=4, seed=0)
    assert dense > 0.85
    assert digits_task_accuracy("linear", width=32, epochs=4, seed=0) == dense
    sketched = digits_task_accuracy("conv2d", 1, 2, width=8, epochs=2, seed=0)
    assert 0.0 <= sketched <= 1.0
    with pytest.raises(ValueError, match="both num_terms and low_rank"):
        digits_task_accuracy("linear", 1, None)
    with pytest.raises(ValueError, match="layer"):
        digits_task_accuracy("attention")


def test_digits_task_accuracy_leaves_the_cuda_generators_alone(monkeypatch):
    """The model is seeded on the CPU; torch.manual_seed would also reseed every CUDA
    generator, which fork_rng(devices=[]) does not restore."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    digits_task_accuracy("linear", 1, 2, width=8, epochs=1, seed=3)
    assert reseeded == []


# ------------------------------------------------------------------ roofline and Pareto front


def test_roofline_is_the_slower_of_compute_and_memory():
    peaks = DevicePeaks(flops_per_s=1e12, bytes_per_s=1e11)
    assert roofline_ms(2e9, 1e6, peaks) == pytest.approx(2.0)  # compute bound: 2 ms
    assert roofline_ms(1e6, 5e8, peaks) == pytest.approx(5.0)  # memory bound: 5 ms


def test_measure_device_peaks_on_cpu_is_positive():
    peaks = measure_device_peaks("cpu", torch.float32, gemm_size=64, copy_bytes=1 << 16, warmup=1, repeats=2)
    assert peaks.flops_per_s > 0 and peaks.bytes_per_s > 0


@requires_cuda
def test_measure_device_peaks_on_cuda_is_plausible():
    peaks = measure_device_peaks("cuda", torch.bfloat16, gemm_size=4096, copy_bytes=1 << 28)
    assert 1e12 < peaks.flops_per_s < 1e16  # 1 TFLOP/s to 10 PFLOP/s
    assert 1e10 < peaks.bytes_per_s < 1e14  # 10 GB/s to 100 TB/s


def test_case_flops_follow_the_design_formula():
    case = LinearCase(300, 200, 16)
    assert case.dense_flops() == 2 * 16 * 300 * 200
    assert case.sketch_flops(2, 8) == 2 * 16 * 2 * 2 * 8 * (300 + 200)
    conv = Conv2dCase(4, 6, batch_size=2, image_size=5, kernel_size=3)
    assert conv.gemm == (2 * 5 * 5, 36, 6, 2 * 4 * 25, 2 * 25 * 6)
    assert conv.dense_flops() == 2 * 50 * 36 * 6


def test_pareto_front_of_a_known_set():
    times = [1.0, 2.0, 3.0, 2.5, 1.0]
    errors = [0.5, 0.3, 0.1, 0.4, 0.6]
    assert pareto_front(times, errors).tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError, match="1-D of one length"):
        pareto_front([1.0], [1.0, 2.0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=15))
def test_pareto_front_points_are_undominated_and_dominate_the_rest(points):
    t, e = np.array(points, dtype=float).T
    front = pareto_front(t, e)
    dominates = lambda i, j: t[i] <= t[j] and e[i] <= e[j] and (t[i] < t[j] or e[i] < e[j])  # noqa: E731
    for j in range(len(t)):
        dominated = any(dominates(i, j) for i in range(len(t)))
        assert front[j] == (not dominated)
        if not front[j]:
            assert any(front[i] and dominates(i, j) for i in range(len(t)))


# ------------------------------------------------------------------ sweeps


def test_sweep_rows_columns_and_values(tmp_path):
    df = tiny_sweep(tmp_path)
    assert list(df.columns) == list(SWEEP_COLUMNS)
    assert df["method"].tolist() == ["dense"] + ["sketched"] * 4
    assert df[["num_terms", "low_rank"]].iloc[1:].astype(int).values.tolist() == [[1, 2], [1, 4], [2, 2], [2, 4]]
    dense, sketched = df.iloc[0], df.iloc[1:]
    assert dense["stored_params"] == 24 * 16 + 16 and dense["speedup"] == 1.0 and dense["error_svd"] == 0.0
    assert (sketched["stored_params"] == 2 * sketched["num_terms"] * sketched["low_rank"] * 40 + 16).all()
    assert (sketched["trainable_params"] == sketched["num_terms"] * sketched["low_rank"] * 40 + 16).all()
    assert (sketched["flops"] == 2 * 4 * 2 * sketched["num_terms"] * sketched["low_rank"] * 40).all()
    for column in ("forward_ms", "forward_backward_ms", "anchor_forward_ms", "peak_memory_bytes"):
        assert (sketched[column] > 0).all(), column
    np.testing.assert_allclose(sketched["speedup"], dense["forward_ms"] / sketched["forward_ms"])
    np.testing.assert_allclose(sketched["anchor_speedup"], sketched["anchor_forward_ms"] / sketched["forward_ms"])
    np.testing.assert_allclose(sketched["memory_ratio"], sketched["peak_memory_bytes"] / dense["peak_memory_bytes"])
    # the optimal fit beats random sketches, and more rank means less error; rank 2Lk=16 = min(in, out) is exact
    assert (sketched["error_svd"] < sketched["error_sketch"]).all()
    assert sketched["error_svd"].iloc[0] > sketched["error_svd"].iloc[1] > sketched["error_svd"].iloc[3]
    assert sketched["error_svd"].iloc[3] < 1e-5
    assert df["roofline_fraction"].isna().all() and df["task_accuracy"].isna().all()  # CPU, no --task-accuracy
    written = pd.read_csv(tmp_path / "sweep.csv")
    assert list(written.columns) == list(SWEEP_COLUMNS)
    np.testing.assert_allclose(written["forward_ms"], df["forward_ms"])


def test_sweep_with_peaks_fills_the_roofline_columns(tmp_path):
    peaks = DevicePeaks(flops_per_s=1e9, bytes_per_s=1e9)
    df = tiny_sweep(tmp_path, peaks=peaks)
    expected = [roofline_ms(f, 0, peaks) for f in df["flops"]]
    assert (df["roofline_ms"] >= np.array(expected)).all()
    np.testing.assert_allclose(df["roofline_fraction"], df["roofline_ms"] / df["forward_ms"])


@requires_cuda
def test_sweep_on_cuda_in_bfloat16_fills_every_measured_column(tmp_path):
    df = run_sweep(LinearCase(256, 128, 64), [1, 2], [8, 16], device="cuda", dtype=torch.bfloat16, warmup=1,
                   repeats=2, progress=False, csv_path=tmp_path / "sweep.csv")
    assert df["device"].eq("cuda").all() and df["dtype"].eq("bfloat16").all()
    sketched = df[df["method"] == "sketched"]
    measured = ["forward_ms", "forward_backward_ms", "peak_memory_bytes", "error_sketch", "error_svd",
                "anchor_forward_ms", "roofline_ms", "roofline_fraction"]
    assert (sketched[measured] > 0).all().all()
    assert (df["roofline_fraction"].notna()).all()  # the dense row too: peaks were measured on the device
    assert (sketched["peak_memory_bytes"] > 2 * sketched["stored_params"]).all()  # parameters plus activations
    assert (sketched["error_svd"] < sketched["error_sketch"]).all()
    assert len(pd.read_csv(tmp_path / "sweep.csv")) == 5


def test_interrupted_sweep_keeps_the_rows_it_finished(tmp_path):
    seen = []

    def stop_after_three(row):
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tiny_sweep(tmp_path, on_row=stop_after_three)
    written = pd.read_csv(tmp_path / "sweep.csv")
    assert len(written) == 3
    assert written["method"].tolist() == ["dense", "sketched", "sketched"]
    assert written["forward_ms"].tolist() == pytest.approx([row["forward_ms"] for row in seen])


def test_conv_sweep_and_task_accuracy(tmp_path):
    df = run_sweep(
        Conv2dCase(3, 5, batch_size=2, image_size=6), [1], [1, 2], warmup=0, repeats=1, progress=False,
        task_accuracy=True, task_width=4, task_epochs=1,
    )
    assert df["layer"].eq("conv2d").all() and df["kernel_size"].eq(3).all() and df["image_size"].eq(6).all()
    assert df["task_accuracy"].between(0, 1).all()
    assert (df["stored_params"].iloc[1:] == [2 * 1 * k * (27 + 5) + 5 for k in (1, 2)]).all()
    assert (df["anchor_forward_ms"].iloc[1:] > 0).all()


def test_sweep_rejects_bad_grids():
    with pytest.raises(ValueError, match="at least one value"):
        run_sweep(LinearCase(4, 4, 2), [], [1])
    with pytest.raises(ValueError, match="low_rank"):
        run_sweep(LinearCase(4, 4, 2), [1], [0])
    with pytest.raises(TypeError, match="LinearCase or Conv2dCase"):
        run_sweep("linear", [1], [1])
    with pytest.raises(ValueError, match="batch_size"):
        LinearCase(4, 4, 0)


def test_plots_are_written(tmp_path):
    df = tiny_sweep(tmp_path)
    for path in (plot_heatmaps(df, tmp_path / "a" / "h.png"), plot_tradeoff(df, tmp_path / "t.png")):
        assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no sketched rows"):
        plot_heatmaps(df.iloc[:1], tmp_path / "none.png")


# ------------------------------------------------------------------ scripts

TINY = ["--in-features", "24", "--out-features", "16", "--batch-size", "4", "--num-terms", "1", "2",
        "--low-rank", "2", "4", "--warmup", "0", "--repeats", "1"]


def test_sweep_cli_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), *TINY, "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(tmp_path / "linear_float32.csv")
    assert list(df.columns) == list(SWEEP_COLUMNS) and len(df) == 5
    for name in ("linear_float32_heatmaps.png", "linear_float32_tradeoff.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "sweep" in result.stderr  # tqdm progress goes to stderr


def test_sweep_cli_conv2d_and_interrupt_keeps_rows_and_plots(tmp_path, monkeypatch, capsys):
    sweep = load_script("benchmarks/sweep.py")
    args = ["--layer", "conv2d", "--in-features", "3", "--out-features", "4", "--batch-size", "2",
            "--image-size", "5", "--num-terms", "1", "--low-rank", "1", "2", "--warmup", "0", "--repeats", "1",
            "--no-progress", "--output-dir", str(tmp_path)]
    assert sweep.main(args) == 0
    assert len(pd.read_csv(tmp_path / "conv2d_float32.csv")) == 3

    real_run_sweep = sweep.run_sweep

    def interrupted_after_two_rows(*a, **kw):
        rows = []

        def on_row(row):
            rows.append(row)
            if len(rows) == 2:
                raise KeyboardInterrupt

        return real_run_sweep(*a, on_row=on_row, **kw)

    monkeypatch.setattr(sweep, "run_sweep", interrupted_after_two_rows)
    out_dir = tmp_path / "interrupted"
    assert sweep.main([*TINY, "--no-progress", "--output-dir", str(out_dir)]) == 130
    assert len(pd.read_csv(out_dir / "linear_float32.csv")) == 2
    assert (out_dir / "linear_float32_heatmaps.png").stat().st_size > 0
    assert "interrupted" in capsys.readouterr().err


def test_bench_sklinear_reports_every_cpu_bar(tmp_path, capsys):
    bench = load_script("benchmarks/bench_sklinear.py")
    args = ["--features", "64", "--batch", "8", "--warmup", "0", "--repeats", "1", "--output-dir", str(tmp_path)]
    assert bench.main(args) == 0
    df = pd.read_csv(tmp_path / "sklinear_bars.csv")
    assert len(df) == 3 and set(df["reference"]) == {"nn.Linear", "anchor"}
    np.testing.assert_allclose(df["measured"], df["reference_ms"] / df["sketched_ms"])
    flop_ratio = {1: 64 * 64 / (2 * 64 * 128), 2: 64 * 64 / (2 * 128 * 128)}
    assert df["required"].tolist() == pytest.approx([0.7 * flop_ratio[1], 2.0, 0.6 * flop_ratio[2]])
    assert (df["passed"] == (df["measured"] >= df["required"])).all()
    out = capsys.readouterr().out
    assert out.count("(required") == 3


def test_bench_sklinear_draws_the_dense_layer_on_the_cpu(monkeypatch):
    """Seeded on the CPU (the same layer on every device), not by reseeding CUDA's generators."""
    bench = load_script("benchmarks/bench_sklinear.py")
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    first, second = (bench.Bench("cpu", torch.float32, 16, 2, 0, 1) for _ in range(2))
    assert reseeded == []
    assert torch.equal(first.dense.weight, second.dense.weight)


def test_parameter_sweep_tutorial_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tutorials" / "parameter_sweep.py"), "--quick", "--device", "cpu",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for section in range(1, 5):
        assert f"== {section}." in result.stdout
    assert "Pareto front" in result.stdout
    assert len(pd.read_csv(tmp_path / "sweep.csv")) == 5
    for name in ("heatmaps.png", "tradeoff.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert not math.isnan(pd.read_csv(tmp_path / "sweep.csv")["error_svd"].iloc[-1])
