"""Importing the layers needs torch alone; the measurement and report libraries load lazily."""
from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("pandas", "matplotlib", "tqdm")


def _modules_loaded_by(statement: str) -> set:
    probe = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {name.split(".")[0] for name in result.stdout.split()}


@pytest.fixture(scope="module")
def loaded_by_torch() -> set:
    # torch itself may import some of them (torch 2.13 imports tqdm): only count what we add.
    return _modules_loaded_by("import torch")


@pytest.mark.parametrize("statement", ["import panther_lite.nn", "import panther_lite", "from panther_lite import convert"])
def test_import_loads_no_pandas_matplotlib_or_tqdm(statement, loaded_by_torch):
    added = (_modules_loaded_by(statement) - loaded_by_torch) & set(HEAVY)
    assert not added, f"{statement!r} imported {sorted(added)}"


def test_benchmark_package_loads_on_first_attribute_access():
    loaded = _modules_loaded_by("import panther_lite; panther_lite.benchmark.time_callable")
    assert "pandas" in loaded


def test_matplotlib_is_an_extra_and_conversion_runs_without_it():
    """pyproject lists matplotlib under [bench] only, and convert/tune/save work with it blocked."""
    import pathlib
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("matplotlib") for dep in project["dependencies"])
    assert any(dep.startswith("matplotlib") for dep in project["optional-dependencies"]["bench"])
    probe = (
        "import sys, tempfile, torch; sys.modules['matplotlib'] = None; import panther_lite; "
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)); x = torch.randn(32, 8); "
        "panther_lite.tune(m, lambda m: 1.0, tolerance=0.5, calibration_data=[x], max_evaluations=2, progress=False); "
        "panther_lite.save_pretrained(m, tempfile.mkdtemp())"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
