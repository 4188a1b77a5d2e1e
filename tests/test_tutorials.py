"""The tutorials this file owns run end to end at tiny sizes (``--quick``), print their
results and write their plots; their helpers measure what they claim to.

(``compress_model.py`` and ``parameter_sweep.py`` are tested by their own test files.)
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from panther_lite.nn import SKLinear

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def run_tutorial(name: str, out_dir: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(TUTORIALS / name), "--quick", "--device", "cpu", "--output-dir", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def load_tutorial(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), TUTORIALS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replace_dense_layers_runs_and_saves_its_plot(tmp_path):
    out = run_tutorial("replace_dense_layers.py", tmp_path)
    for expected in ("dense: test accuracy", "sketched: test accuracy", "nn.Linear: forward", "speed-up over nn.Linear",
                     "training-forward memory"):
        assert expected in out
    assert (tmp_path / "replace_dense_layers.png").stat().st_size > 0


def test_performance_runs_every_section_and_saves_plot_and_trace(tmp_path):
    out = run_tutorial("performance.py", tmp_path)
    for section in range(1, 7):
        assert f"== {section}." in out
    assert "panther_lite::sketched_linear" in out  # the profiler sees the custom op
    assert "outputs equal" in out
    assert "vs the anchor's per-term formulation" in out and "saved for backward" in out
    assert (tmp_path / "performance.png").stat().st_size > 0
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_make_mlp_sketches_hidden_layers_only():
    tutorial = load_tutorial("replace_dense_layers.py")
    model = tutorial.make_mlp([12, 40, 40, 3], num_terms=1, low_rank=2)
    kinds = [type(m) for m in model if not isinstance(m, nn.ReLU)]
    assert kinds == [SKLinear, SKLinear, nn.Linear]
    trainable, stored = tutorial.parameter_counts(model)
    sketched = [m.parameter_counts() for m in model if isinstance(m, SKLinear)]
    assert trainable == sum(s.trainable for s in sketched) + 40 * 3 + 3
    assert stored == sum(s.stored for s in sketched) + 40 * 3 + 3
    dense = tutorial.make_mlp([12, 40, 3])
    assert all(isinstance(m, (nn.Linear, nn.ReLU)) for m in dense)


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
