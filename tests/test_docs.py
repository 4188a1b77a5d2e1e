"""The Sphinx site builds without a single warning, documents the public API, shows every
committed benchmark plot and table, and names only things that exist."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
# :func:`~panther_lite.nn.align_rank`, :func:`panther_lite.convert() <panther_lite.convert.convert>`, ...
PY_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data):`(?:[^`<]*<)?~?(panther_lite[\w.]*)>?`")


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("docs")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return out / "html"


def test_build_is_warning_free_and_has_every_page(html):
    for page in ("index", "math", "workflows", "command", "huggingface", "training", "deployment", "benchmarks",
                 "panther_comparison", "api"):
        assert (html / f"{page}.html").is_file(), page


def test_api_reference_documents_the_public_names(html):
    api = (html / "api.html").read_text()
    import panther_lite
    from panther_lite import benchmark, nn, sketch

    names = {f"panther_lite.nn.{n}" for n in nn.__all__} | {f"panther_lite.sketch.{n}" for n in sketch.__all__}
    names |= {f"panther_lite.benchmark.{n}" for n in benchmark.__all__ if callable(getattr(benchmark, n))}
    names |= {f"panther_lite.conversion.{n}" for n in panther_lite.conversion.__all__}
    missing = sorted(n for n in names if f'id="{n}"' not in api)
    assert not missing, f"not in the API reference: {missing}"
    assert callable(panther_lite.convert) and callable(panther_lite.densify) and callable(panther_lite.tune)


def test_math_page_states_the_identities(html):
    math = (html / "math.html").read_text()
    for phrase in ("concatenation identity", "Eckart", "whitening", "trainable", "stored", "SKConv2d"):
        assert phrase in math, phrase


def test_benchmark_page_shows_every_committed_plot_and_table(html):
    page = (html / "benchmarks.html").read_text()
    pngs = sorted(RESULTS.glob("*/**/*.png"))  # one folder per device, sweeps in subfolders
    csvs = sorted(RESULTS.glob("*/**/*.csv"))
    images = {p.name for p in (html / "_images").glob("*.png")} if (html / "_images").is_dir() else set()
    for png in pngs:
        assert png.name in images, png
        assert str(png.relative_to(ROOT)) in page, png
    for csv in csvs:
        assert str(csv.relative_to(ROOT)) in page, csv
    if not pngs and not csvs:
        assert "No benchmark results" in page


def test_every_documented_api_name_exists():
    names = set()
    for rst in DOCS.glob("*.rst"):
        names |= set(PY_ROLE.findall(rst.read_text()))
    assert names
    for name in sorted(names):
        parts = name.split(".")
        for split in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for attr in parts[split:]:
                assert hasattr(obj, attr), f"{name}: {obj!r} has no attribute {attr!r}"
                obj = getattr(obj, attr)
            break
        else:
            pytest.fail(f"{name}: no importable module")


def test_workflow_page_covers_every_tutorial():
    text = (DOCS / "workflows.rst").read_text()
    for script in ("replace_dense_layers.py", "compress_model.py", "parameter_sweep.py", "performance.py"):
        assert f"tutorials/{script}" in text, script
