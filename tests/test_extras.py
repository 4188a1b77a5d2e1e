"""A missing optional dependency is an ImportError naming the extra that installs it, at every
place panther_lite imports one lazily (simulated with ``sys.modules[name] = None``)."""
from __future__ import annotations

import logging
import sys

import pandas as pd
import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.extras import EXTRAS, quiet_optional_imports, require

HF, BENCH = 'pip install "panther_lite[hf]"', 'pip install "panther_lite[bench]"'
DEPLOY = 'pip install "panther_lite[deploy]"'


def _hide(monkeypatch, top: str) -> None:
    """Make ``top`` and its loaded submodules unimportable for the rest of the test."""
    for name in [name for name in sys.modules if name == top or name.startswith(f"{top}.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, top, None)


def test_require_returns_an_installed_module_and_names_the_extra_of_a_missing_one(monkeypatch):
    assert require("json", "reading") is sys.modules["json"]
    _hide(monkeypatch, "onnx")
    with pytest.raises(ModuleNotFoundError, match=r"^exporting needs 'onnx', which is not installed: ") as error:
        require("onnx.checker", "exporting")
    assert str(error.value).endswith(DEPLOY) and error.value.name == "onnx.checker"
    assert set(EXTRAS.values()) == {"hf", "bench", "deploy", None}


def test_a_missing_dependency_of_an_installed_package_keeps_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "panther_lite_fake_plugin.py").write_text("import panther_lite_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'panther_lite_no_such_dependency'"):
        require("panther_lite_fake_plugin", "a plugin")


def test_save_pretrained_of_a_plain_model_names_safetensors_a_base_dependency(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    panther_lite.convert(model, num_terms=1, low_rank=2, progress=False)
    _hide(monkeypatch, "safetensors")
    with pytest.raises(ImportError, match="save_pretrained needs 'safetensors'.*pip install safetensors"):
        panther_lite.save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


def test_plots_name_the_bench_extra(monkeypatch):
    from panther_lite.benchmark import new_figure

    _hide(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match="plotting needs 'matplotlib'") as error:
        new_figure()
    assert str(error.value).endswith(BENCH)
    search = pd.DataFrame({"stored_ratio": [1.0], "score": [1.0]})
    report = pd.DataFrame()
    report.attrs["search"] = search
    with pytest.raises(ImportError, match=r"plotting needs 'matplotlib'.*\[bench\]"):
        panther_lite.plot_search(report)


def test_onnx_helpers_name_the_deploy_extra(tmp_path, monkeypatch):
    from panther_lite.benchmark import export_onnx, onnx_runner, quantize_onnx_int8

    for name in ("onnx", "onnxscript", "onnxruntime"):
        _hide(monkeypatch, name)
    x = torch.randn(2, 4)
    for dynamo, missing in ((False, "onnx"), (True, "onnxscript")):
        with pytest.raises(ImportError, match=rf"export_onnx needs '{missing}'.*\[deploy\]"):
            export_onnx(nn.Linear(4, 2), (x,), tmp_path / "m.onnx", ["x"], {"x": {0: "batch"}}, dynamo=dynamo)
    with pytest.raises(ImportError, match=r"onnx_runner needs 'onnxruntime'.*\[deploy\]"):
        onnx_runner(tmp_path / "m.onnx")
    with pytest.raises(ImportError, match=r"quantize_onnx_int8 needs 'onnxruntime'.*\[deploy\]"):
        quantize_onnx_int8(tmp_path / "m.onnx", tmp_path / "q.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_the_command_without_transformers_names_the_hf_extra(tmp_path, monkeypatch, capsys):
    from panther_lite.cli import main

    _hide(monkeypatch, "transformers")
    argv = ["compress", str(tmp_path), "--calibration", str(tmp_path / "t.txt"), "--output", str(tmp_path / "out"),
            "--param-ratio", "0.5"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"python -m panther_lite compress: error: the compress command needs 'transformers', which " \
                          f"is not installed: {HF}"


def test_the_command_without_matplotlib_writes_the_model_and_says_why_there_is_no_plot(
    checkpoints, text_file, tmp_path, monkeypatch, capsys
):
    pytest.importorskip("transformers")
    from panther_lite.cli import main

    _hide(monkeypatch, "matplotlib")
    output = tmp_path / "out"
    argv = ["compress", str(checkpoints["gpt2"]), "--calibration", str(text_file), "--output", str(output),
            "--param-ratio", "0.5", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert "warning: report.png not written: " in capsys.readouterr().err
    assert (output / "model.safetensors.index.json").is_file() and not (output / "report.png").exists()


def test_quiet_optional_imports_hides_load_notes_only_within_the_block(caplog):
    torchao_log, pytree_log = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    levels = torchao_log.level, pytree_log.level
    with caplog.at_level(logging.WARNING):
        with quiet_optional_imports():
            torchao_log.warning("Failed to load _C.so")
            pytree_log.warning("register_constant() on Enum subclasses is deprecated")
            torchao_log.error("a real error")
        torchao_log.warning("after the block")
    assert [record.getMessage() for record in caplog.records] == ["a real error", "after the block"]
    assert (torchao_log.level, pytree_log.level) == levels
