"""The package as users install it: a wheel built from the checkout holds the license, the
``py.typed`` marker and the ``panther-lite`` console script, with PEP 639 metadata; the
script and ``--version`` work."""
from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import panther_lite

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built (no dependencies, no isolation: offline) from a copy of the sources, so the
    checkout gets no build/ or egg-info."""
    pytest.importorskip("setuptools")
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "panther_lite", source / "panther_lite", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("panther_lite-*.whl")
    return zipfile.ZipFile(built)


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [entry for entry in wheel.namelist() if entry.split("/")[0].endswith(".dist-info") and
               entry.endswith(name)]  # fmt: skip
    return wheel.read(path).decode()


def test_the_wheel_holds_py_typed_the_license_and_the_console_script(wheel):
    names = wheel.namelist()
    assert "panther_lite/py.typed" in names
    assert f"panther_lite-{panther_lite.__version__}.dist-info/licenses/LICENSE" in names
    assert "MIT License" in _dist_info(wheel, "licenses/LICENSE")
    entry_points = _dist_info(wheel, "entry_points.txt")
    assert "[console_scripts]" in entry_points and "panther-lite = panther_lite.cli:main" in entry_points


def test_the_metadata_states_the_license_python_and_base_dependencies(wheel):
    metadata = email.message_from_string(_dist_info(wheel, "METADATA"))
    assert metadata["License-Expression"] == "MIT" and metadata["Requires-Python"] == ">=3.10"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert "Inspired by, https://github.com/FahdSeddik/panther" in metadata.get_all("Project-URL")
    base = [req for req in metadata.get_all("Requires-Dist") if "extra ==" not in req]
    assert {req.split(">")[0] for req in base} == {"torch", "numpy", "pandas", "tqdm", "safetensors"}


def test_the_console_script_runs_the_command_line_under_its_own_name(tmp_path):
    # what pip writes for the entry point panther-lite = panther_lite.cli:main
    script = tmp_path / "panther-lite"
    script.write_text("import sys\nfrom panther_lite.cli import main\nsys.exit(main())\n")

    def run(*args):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"panther_lite {panther_lite.__version__}"
    bad = run("compress", str(tmp_path / "absent"), "--calibration", "t.txt", "--output", "o", "--param-ratio", "0.5")
    assert bad.returncode == 1 and bad.stderr.startswith("panther-lite compress: error: "), bad.stderr
