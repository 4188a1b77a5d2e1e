"""The tutorials run end to end at tiny sizes (``--quick``), print their results and write
their plots; their helpers measure what they claim to. Nothing here depends on timing:
only that times were measured, never their values or their order.

(``compress_model.py`` is tested by its own test file.)
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd
import torch

from panther_lite.nn import SKLinear

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def run_tutorial(name: str, out_dir: Path, capsys) -> str:
    """Run a tutorial's ``main`` in this process (no second interpreter to start) at tiny
    sizes on the CPU; returns what it printed."""
    load_tutorial(name).main(["--quick", "--device", "cpu", "--output-dir", str(out_dir)])
    return capsys.readouterr().out


def load_tutorial(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), TUTORIALS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replace_dense_layers_runs_and_saves_its_plot(tmp_path, capsys):
    out = run_tutorial("replace_dense_layers.py", tmp_path, capsys)
    for expected in ("dense: test accuracy", "sketched: test accuracy", "nn.Linear: forward", "speed-up over nn.Linear",
                     "training-forward memory"):
        assert expected in out
    assert (tmp_path / "replace_dense_layers.png").stat().st_size > 0


def test_performance_runs_every_section_and_saves_plot_and_trace(tmp_path, capsys):
    out = run_tutorial("performance.py", tmp_path, capsys)
    for section in range(1, 7):
        assert f"== {section}." in out
    # the profiler saw the custom op: looked up by name, not by its rank in a table sorted by time
    seen = re.search(r"saw the custom op panther_lite::sketched_linear (\d+) times", out)
    assert seen and int(seen.group(1)) >= 3, out[-3000:]
    assert "outputs equal" in out
    assert "vs the anchor's per-term formulation" in out and "saved for backward" in out
    assert (tmp_path / "performance.png").stat().st_size > 0
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_performance_sizes_follow_the_device():
    tutorial = load_tutorial("performance.py")
    cpu, gpu = tutorial.default_sizes(torch.device("cpu")), tutorial.default_sizes(torch.device("cuda"))
    assert (gpu["width"], gpu["batch"]) == (4096, 1024)
    # on 2 CPU cores the whole tutorial takes about a minute: a 1024² layer, 128 rows, 10 steps
    assert (cpu["width"], cpu["batch"], cpu["steps"]) == (1024, 128, 10)
    assert tutorial.default_sizes(torch.device("cuda"), quick=True)["width"] == 128


def test_performance_memory_section_reports_the_library_measurements():
    tutorial = load_tutorial("performance.py")
    width, batch, num_terms, low_rank = 32, 6, 2, 3
    rows, per_term = tutorial.section_memory(torch.device("cpu"), width, batch, num_terms, low_rank)
    # nn.Linear saves its input for the weight gradient; SKLinear also x·U2 (batch × Lk)
    assert rows["nn.Linear"]["saved"] == batch * width * 4
    assert rows["SKLinear"]["saved"] == (batch * width + batch * num_terms * low_rank) * 4
    assert rows["nn.Linear"]["parameters"] == (width * width + width) * 4
    stored = SKLinear(width, width, num_terms, low_rank).parameter_counts().stored
    assert rows["SKLinear"]["parameters"] == stored * 4
    for row in rows.values():  # on the CPU: parameters + saved activations
        assert row["training"] == row["parameters"] + row["saved"]
    assert per_term == num_terms * batch * width * 4


def test_performance_timing_section_times_with_the_library_and_the_anchor():
    tutorial = load_tutorial("performance.py")
    timings = tutorial.section_timing(torch.device("cpu"), 32, 4, 2, 2, warmup=0, repeats=2)
    assert set(timings) == {"naive", "time_callable", "anchor (per-term)"}
    assert all(value > 0 for value in timings.values())


def test_replace_dense_layers_reports_memory_on_the_cpu():
    tutorial = load_tutorial("replace_dense_layers.py")
    width, batch = 24, 5
    dense, sketched = tutorial.layer_costs(width, batch, 1, 2, torch.device("cpu"), torch.float32, 0, 1)
    assert dense["stored_params"] == width * width + width
    assert dense["parameter_mib"] * 2**20 == dense["stored_params"] * 4
    assert sketched["parameter_mib"] * 2**20 == sketched["stored_params"] * 4
    # training forward on the CPU = parameters + saved activations (x; and x plus x·U2, batch × Lk)
    assert dense["training_memory_mib"] * 2**20 == (dense["stored_params"] + batch * width) * 4
    assert sketched["training_memory_mib"] * 2**20 == (sketched["stored_params"] + batch * width + batch * 2) * 4


def test_parameter_sweep_tutorial_runs(tmp_path, capsys):
    out = run_tutorial("parameter_sweep.py", tmp_path, capsys)
    for section in range(1, 5):
        assert f"== {section}." in out
    assert "Pareto front" in out
    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert len(sweep) == 5 and sweep["error_svd"].notna().all()
    for name in ("heatmaps.png", "tradeoff.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_parameter_sweep_never_recommends_a_configuration_with_a_noisy_timing(capsys):
    from panther_lite.benchmark import LinearCase, run_sweep

    df = run_sweep(LinearCase(24, 16, 4), [1, 2], [2, 4], warmup=0, repeats=1, progress=False)
    noisy = df.index[(df["num_terms"] == 2) & (df["low_rank"] == 4)][0]
    df.loc[noisy, ["forward_ms", "error_svd"]] = [1e-6, 1e-9]  # the fastest and most accurate ...
    df.loc[noisy, "speedup_iqr"] = 10 * df.loc[noisy, "speedup"]  # ... measured on a busy machine
    best = load_tutorial("parameter_sweep.py").recommend(df, error_budget=1.0)
    out, err = capsys.readouterr()
    assert best is not None and (best["num_terms"], best["low_rank"]) != (2, 4)
    assert "L=2 k=4" not in out.split("Pareto front")[1]
    assert err.startswith("warning: 1 of 4 configurations have a timing whose IQR exceeds 50% of its median")


def test_deploy_exports_freezes_quantizes_and_compares_the_forms(tmp_path, capsys):
    out = run_tutorial("deploy.py", tmp_path, capsys)
    for exporter in ("TorchScript", "dynamo"):
        assert f"{exporter} exporter: 4 MatMul nodes" in out
    assert "quantize_dynamic before freeze: 2 sketched layers skipped" in out and "freeze noticed it: 1 warning" in out
    assert "2 frozen pairs, 5 int8 Linear layers" in out
    assert out.count("ms for 450 rows") == 10
    assert (tmp_path / "deploy.png").stat().st_size > 0
