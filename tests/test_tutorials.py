"""The tutorials this file owns run end to end at tiny sizes (``--quick``), print their
results and write their plots; their helpers measure what they claim to.

(``compress_model.py`` and ``parameter_sweep.py`` are tested by their own test files.)
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
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
    for expected in ("dense: test accuracy", "sketched: test accuracy", "nn.Linear: forward", "speed-up over nn.Linear"):
        assert expected in out
    assert (tmp_path / "replace_dense_layers.png").stat().st_size > 0


def test_performance_runs_every_section_and_saves_plot_and_trace(tmp_path):
    out = run_tutorial("performance.py", tmp_path)
    for section in range(1, 7):
        assert f"== {section}." in out
    assert "panther_lite::sketched_linear" in out  # the profiler sees the custom op
    assert "outputs equal" in out
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


def test_saved_bytes_counts_activations_not_parameters():
    tutorial = load_tutorial("performance.py")
    x = torch.randn(6, 10, requires_grad=True)
    dense = nn.Linear(10, 7)
    assert tutorial.saved_bytes(lambda: dense(x), list(dense.parameters())) == x.numel() * 4
    layer = SKLinear(10, 7, 1, 2, seed=0)
    tensors = list(layer.parameters()) + list(layer.buffers())
    # x and the batch × 2Lk hidden activation; the factors and sketches are not counted
    assert tutorial.saved_bytes(lambda: layer(x), tensors) == (6 * 10 + 6 * 4) * 4


def test_per_term_formulation_equals_the_layer():
    tutorial = load_tutorial("performance.py")
    layer = SKLinear(40, 33, num_terms=3, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(5, 40, dtype=torch.float64)
    torch.testing.assert_close(tutorial.per_term_forward(layer, x), layer(x), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_event_timing_measures_gpu_work():
    tutorial = load_tutorial("performance.py")
    a = torch.randn(2048, 2048, device="cuda")
    small = tutorial.cuda_event_ms(lambda: a[:256, :256] @ a[:256, :256], warmup=2, repeats=5)
    large = tutorial.cuda_event_ms(lambda: a @ a, warmup=2, repeats=5)
    assert 0 < small < large
