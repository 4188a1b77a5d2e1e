"""Sweeps: every column and value, timings interleaved with the dense baseline (fair under
a burst of load), roofline columns, rows kept when interrupted, arguments checked first."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from panther_lite.benchmark import SWEEP_COLUMNS, Conv2dCase, DevicePeaks, LinearCase, roofline_ms, run_sweep


def test_sweep_rows_columns_and_values(tmp_path, tiny_sweep):
    df = tiny_sweep(repeats=3)
    assert list(df.columns) == list(SWEEP_COLUMNS)
    assert df["method"].tolist() == ["dense"] + ["sketched"] * 4
    assert df[["num_terms", "low_rank"]].iloc[1:].astype(int).values.tolist() == [[1, 2], [1, 4], [2, 2], [2, 4]]
    dense, sketched = df.iloc[0], df.iloc[1:]
    assert dense["stored_params"] == 24 * 16 + 16 and dense["speedup"] == 1.0 and dense["error_svd"] == 0.0
    assert (df["repeats"] == 3).all()
    assert (sketched["stored_params"] == 2 * sketched["num_terms"] * sketched["low_rank"] * 40 + 16).all()
    assert (sketched["trainable_params"] == sketched["num_terms"] * sketched["low_rank"] * 40 + 16).all()
    assert (sketched["flops"] == 2 * 4 * 2 * sketched["num_terms"] * sketched["low_rank"] * 40).all()
    measured = ["forward_ms", "forward_backward_ms", "dense_forward_ms", "dense_forward_backward_ms",
                "anchor_forward_ms", "peak_memory_bytes", "speedup", "speedup_forward_backward", "anchor_speedup"]
    assert (sketched[measured] > 0).all().all()
    spreads = ["forward_iqr_ms", "forward_backward_iqr_ms", "speedup_iqr", "speedup_forward_backward_iqr",
               "anchor_speedup_iqr"]
    assert (sketched[spreads] >= 0).all().all()
    np.testing.assert_allclose(sketched["memory_ratio"], sketched["peak_memory_bytes"] / dense["peak_memory_bytes"])
    # the optimal fit beats random sketches, and more rank means less error; rank 2Lk=16 = min(in, out) is exact
    assert (sketched["error_svd"] < sketched["error_sketch"]).all()
    assert sketched["error_svd"].iloc[0] > sketched["error_svd"].iloc[1] > sketched["error_svd"].iloc[3]
    assert sketched["error_svd"].iloc[3] < 1e-5
    assert df["roofline_fraction"].isna().all() and df["task_accuracy"].isna().all()  # CPU, no task_accuracy
    written = pd.read_csv(tmp_path / "sweep.csv")
    assert list(written.columns) == list(SWEEP_COLUMNS)
    np.testing.assert_allclose(written["forward_ms"], df["forward_ms"])


def test_speedups_are_per_round_ratios_unbiased_by_a_burst_of_load(tiny_sweep, fake_clock):
    """Every timed call costs the same on the fake clock, and a burst of load starts after
    the dense row: timing the dense baseline once at the start would report a 50× slow-down
    for every configuration; each timed in alternation with its own baseline reports 1."""
    every_call_costs_one_ms = torch.nn.Module.__call__

    def call(module, *args, **kwargs):
        fake_clock.advance(1.0)
        return every_call_costs_one_ms(module, *args, **kwargs)

    def burst_after_the_dense_row(row):
        fake_clock.load = 50.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "__call__", call)
        df = tiny_sweep(repeats=3, on_row=burst_after_the_dense_row)
    sketched = df[df["method"] == "sketched"]
    for column in ("speedup", "speedup_forward_backward"):
        np.testing.assert_allclose(sketched[column], 1.0, rtol=1e-9)
    np.testing.assert_allclose(sketched["speedup_iqr"], 0.0, atol=1e-9)
    np.testing.assert_allclose(sketched["dense_forward_ms"], 50 * df["forward_ms"].iloc[0], rtol=1e-9)


def test_sweep_with_peaks_fills_the_roofline_columns(tiny_sweep):
    peaks = DevicePeaks(flops_per_s=1e9, bytes_per_s=1e9)
    df = tiny_sweep(peaks=peaks)
    expected = [roofline_ms(f, 0, peaks) for f in df["flops"]]
    assert (df["roofline_ms"] >= np.array(expected)).all()
    np.testing.assert_allclose(df["roofline_fraction"], df["roofline_ms"] / df["forward_ms"])


def test_interrupted_sweep_keeps_the_rows_it_finished(tmp_path, tiny_sweep):
    (tmp_path / "sweep.csv").write_text("a previous run's rows\n")
    seen = []

    def stop_after_three(row):
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tiny_sweep(on_row=stop_after_three)
    written = pd.read_csv(tmp_path / "sweep.csv")
    assert len(written) == 3
    assert written["method"].tolist() == ["dense", "sketched", "sketched"]
    assert written["forward_ms"].tolist() == pytest.approx([row["forward_ms"] for row in seen])


def test_conv_sweep_and_task_accuracy():
    df = run_sweep(
        Conv2dCase(3, 5, batch_size=2, image_size=6), [1], [1, 2], warmup=0, repeats=1, progress=False,
        task_accuracy=True, task_width=4, task_epochs=1,
    )  # fmt: skip
    assert df["layer"].eq("conv2d").all() and df["kernel_size"].eq(3).all() and df["image_size"].eq(6).all()
    assert df["task_accuracy"].between(0, 1).all()
    assert (df["stored_params"].iloc[1:] == [2 * 1 * k * (27 + 5) + 5 for k in (1, 2)]).all()
    assert (df["anchor_forward_ms"].iloc[1:] > 0).all()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_terms=[]), ValueError, "at least one value"),
        (dict(low_rank=[0]), ValueError, "low_rank"),
        (dict(case="linear"), TypeError, "LinearCase or Conv2dCase"),
        (dict(decay=-1.0), ValueError, "decay"),
        (dict(decay=float("nan")), ValueError, "decay"),
        (dict(repeats=0), ValueError, "repeats"),
        (dict(warmup=-1), ValueError, "warmup"),
        (dict(task_epochs=0), ValueError, "task_epochs"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
        (dict(device="meta"), ValueError, "CPU or CUDA"),
    ],
)
def test_sweep_checks_every_argument_before_touching_the_csv(tmp_path, kwargs, error, message):
    csv_path = tmp_path / "sweep.csv"
    csv_path.write_text("a previous run's rows\n")
    arguments = dict(case=LinearCase(4, 4, 2), num_terms=[1], low_rank=[1], csv_path=csv_path, progress=False)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        run_sweep(**arguments)
    assert csv_path.read_text() == "a previous run's rows\n" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.cuda
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
