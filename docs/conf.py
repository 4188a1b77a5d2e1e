"""Sphinx configuration for the panther_lite documentation.

Only Sphinx's built-in extensions are used. Two small directives are defined here:

* ``benchmark-results`` renders whatever the benchmark suite committed under
  ``benchmarks/results/<device>/`` — every PNG as a figure and every CSV as a table —
  at build time, so pages never name a file that may be missing and never copy numbers
  by hand;
* ``optional-literalinclude`` is ``literalinclude`` for files that may be absent from a
  checkout (it prints a note instead of failing the build).
"""
from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive, directives
from sphinx.directives.code import LiteralInclude

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

import panther_lite  # noqa: E402

project = "panther_lite"
author = "panther_lite contributors"
copyright = "2026, panther_lite contributors"
release = panther_lite.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = f"panther_lite {release}"
html_static_path: list = []

# Columns rendered with this many significant digits in generated tables.
SIGNIFICANT_DIGITS = 4
# Longest table rendered in full; longer CSVs show their first rows and name the file.
MAX_TABLE_ROWS = 60


def _format_cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.{SIGNIFICANT_DIGITS}g}"
    return str(value).replace("|", "\\|")


def _csv_table_lines(csv_path: Path, title: str) -> list:
    """reStructuredText ``list-table`` lines for ``csv_path`` (read with pandas)."""
    import pandas as pd

    frame = pd.read_csv(csv_path)
    shown = frame.head(MAX_TABLE_ROWS)
    lines = [f".. list-table:: {title}", "   :header-rows: 1", ""]
    for row in [list(shown.columns)] + shown.values.tolist():
        for col_index, cell in enumerate(row):
            bullet = "   * - " if col_index == 0 else "     - "
            lines.append(bullet + (_format_cell(cell) or " "))
    lines.append("")
    if len(frame) > len(shown):
        lines += [f"(First {len(shown)} of {len(frame)} rows; the full table is ``{csv_path.relative_to(ROOT)}``.)", ""]
    return lines


class BenchmarkResults(Directive):
    """Figures and tables for the files under ``benchmarks/results/<device>/`` (and its
    subfolders, e.g. one sweep per size).

    Options: ``:pattern:`` — a glob on file names (default ``*``); ``:kind:`` —
    ``figures``, ``tables`` or ``both`` (default).
    """

    option_spec = {"pattern": directives.unchanged, "kind": lambda arg: directives.choice(arg, ("figures", "tables", "both"))}

    def run(self):
        pattern = self.options.get("pattern", "*")
        kind = self.options.get("kind", "both")
        env = self.state.document.settings.env
        doc_dir = Path(env.doc2path(env.docname)).parent
        suffixes = {"figures": (".png",), "tables": (".csv",), "both": (".png", ".csv")}[kind]
        devices = sorted(p for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []
        lines = []
        for device in devices:
            files = sorted(
                f for f in device.rglob("*") if f.suffix in suffixes and fnmatch.fnmatch(f.name, pattern)
            )
            if not files:
                continue
            env.note_dependency(str(device))
            lines += [f"**Device: {device.name}**", ""]
            for f in files:
                env.note_dependency(str(f))
                rel = os.path.relpath(f, doc_dir)
                if f.suffix == ".png":
                    lines += [f".. figure:: {rel}", "   :width: 100%", "", f"   ``{f.relative_to(ROOT)}``", ""]
                else:
                    lines += _csv_table_lines(f, f"``{f.relative_to(ROOT)}``")
        if not lines:
            message = (
                f"No benchmark results matching {pattern!r} are committed in this checkout "
                "(benchmarks/results/<device>/). Run ``bash scripts/sweep.sh`` to produce them."
            )
            return [nodes.note("", nodes.paragraph(text=message))]
        self.state_machine.insert_input(lines, str(DOCS / "conf.py"))
        return []


class OptionalLiteralInclude(LiteralInclude):
    """``literalinclude`` that renders a note when the file does not exist."""

    def run(self):
        _, path = self.env.relfn2path(self.arguments[0])
        if not os.path.exists(path):
            text = f"{self.arguments[0]} is not part of this checkout."
            return [nodes.note("", nodes.paragraph(text=text))]
        return super().run()


def setup(app):
    app.add_directive("benchmark-results", BenchmarkResults)
    app.add_directive("optional-literalinclude", OptionalLiteralInclude)
    return {"parallel_read_safe": True}
