"""The deployment measurements: each form of a model is what its name says (the dense model
untouched, frozen pairs, int8 layers), sizes on disk shrink as the forms promise, ONNX
graphs run in onnxruntime like the modules in PyTorch, and the benchmark script writes its
CSV and plot. Nothing here depends on timing values."""
from __future__ import annotations

import math
import sys

import pandas as pd
import pytest
import torch
import torch.nn as nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from panther_lite.benchmark.deploy import (  # noqa: E402
    DEPLOY_COLUMNS, DEPLOY_FORMS, deploy_rows, deployable_forms, export_onnx, onnx_runner, plot_deploy,
    saved_size_bytes,
)
from panther_lite.conversion import FrozenLinear  # noqa: E402
from panther_lite.nn import SKLinear  # noqa: E402

DYNAMIC_LINEAR = torch.ao.nn.quantized.dynamic.Linear


@pytest.fixture
def forms():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    state = {key: value.clone() for key, value in dense.state_dict().items()}
    forms = deployable_forms(dense, target_modules=["0", "2"], num_terms=1, low_rank=4)
    assert forms["dense fp32"] is dense
    assert all(torch.equal(value, dense.state_dict()[key]) for key, value in state.items())
    return forms


def test_each_form_holds_the_layers_its_name_says(forms):
    assert tuple(forms) == DEPLOY_FORMS
    assert isinstance(forms["converted"][2], SKLinear)
    assert isinstance(forms["frozen"][2], FrozenLinear)
    assert all(isinstance(m, DYNAMIC_LINEAR) for m in forms["frozen + int8"][2])
    assert isinstance(forms["dense int8"][2], DYNAMIC_LINEAR)


def test_sizes_on_disk_shrink_with_rank_and_with_int8(forms, tmp_path):
    size = {form: saved_size_bytes(forms[form], tmp_path / f"{form}.pt") for form in DEPLOY_FORMS}
    assert size["frozen + int8"] < size["frozen"] < size["dense fp32"]
    assert size["dense int8"] < size["dense fp32"]


def test_rows_measure_every_form_in_both_runtimes_with_matching_outputs(forms):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = forms["dense fp32"](x)

    def cosine(run) -> float:
        return torch.nn.functional.cosine_similarity(run(x).flatten(), reference.flatten(), dim=0).item()

    rows = pd.DataFrame(deploy_rows(forms, (x,), ["x"], {"x": {0: "batch"}}, cosine, repeats=1))
    assert list(rows.columns) == list(DEPLOY_COLUMNS) and len(rows) == 2 * len(DEPLOY_FORMS)
    assert rows["latency_ms"].map(math.isfinite).all() and (rows["size_mb"] > 0).all()
    quality = rows.set_index(["form", "runtime"])["quality"]
    assert quality["dense fp32", "onnxruntime"] == pytest.approx(1.0, abs=1e-6)
    for form in ("converted", "frozen"):  # the same function in both runtimes
        assert quality[form, "onnxruntime"] == pytest.approx(quality[form, "pytorch"], abs=1e-6)
    for runtime in ("pytorch", "onnxruntime"):  # int8 costs little next to the rank (random weights: full rank)
        assert quality["dense int8", runtime] >= 0.99
        assert quality["frozen + int8", runtime] == pytest.approx(quality["frozen", runtime], abs=0.01)


def test_bench_deploy_writes_csv_and_plot(tmp_path, load_script, capsys):
    bench = load_script("benchmarks/bench_deploy.py")
    bench.main(["--quick", "--only", "digits", "--output-dir", str(tmp_path)])
    df = pd.read_csv(tmp_path / "deploy.csv")
    assert list(df.columns) == bench.COLUMNS and len(df) == 2 * len(DEPLOY_FORMS)
    assert set(df["runtime"]) == {"pytorch", "onnxruntime"} and (df["quality"] > 0.5).all()
    assert (tmp_path / "deploy.png").stat().st_size > 0


def test_onnx_runner_refuses_a_provider_this_build_lacks_instead_of_falling_back(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    path = export_onnx(model, (torch.randn(2, 8),), tmp_path / "m.onnx", ["x"], {"x": {0: "batch"}})
    torch.testing.assert_close(onnx_runner(path)(torch.ones(3, 8)), model(torch.ones(3, 8)).detach())
    with pytest.raises(ValueError, match="NoSuchExecutionProvider"):
        onnx_runner(path, provider="NoSuchExecutionProvider")


def test_bench_onnx_cuda_says_when_onnxruntime_has_no_cuda_provider(tmp_path, load_script, capsys, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    bench = load_script("benchmarks/bench_onnx_cuda.py")
    assert bench.main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDAExecutionProvider" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_plot_is_drawn_without_pyplot(tmp_path):
    rows = [dict(form=form, runtime=runtime, size_mb=1.0, latency_ms=2.0, latency_iqr_ms=0.1, quality=0.9)
            for form in DEPLOY_FORMS for runtime in ("pytorch", "onnxruntime")]
    path = plot_deploy(pd.DataFrame(rows), tmp_path / "deploy.png", title="t")
    assert path.stat().st_size > 0 and "matplotlib.pyplot" not in sys.modules
