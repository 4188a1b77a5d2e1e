"""The package's size limits: no file over 450 lines, no function over 60 code lines (lines
that are not blank, not comments and not the function's docstring); every conversion module says
what it owns; importing the command loads nothing from the benchmark library."""
from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "panther_lite"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def _non_code_lines(source: str) -> set:
    """Line numbers holding only comments, or blank."""
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code.update(range(token.start[0], token.end[0] + 1))
    return set(range(1, source.count("\n") + 2)) - code


def function_code_lines(source: str) -> dict:
    """``{"name (line)": code lines}`` of every function in ``source`` (nested ones included in
    their parent's count, docstrings excluded)."""
    skipped = _non_code_lines(source)
    sizes = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = set(range(node.lineno, node.end_lineno + 1)) - skipped
        body = node.body[0]
        if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str):
            lines -= set(range(body.lineno, body.end_lineno + 1))
        sizes[f"{node.name} (line {node.lineno})"] = len(lines)
    return sizes


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_counter_counts_code_lines_only():
    source = 'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = (x +\n         1)\n    return y\n'
    assert function_code_lines(source) == {"f (line 1)": 4}


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_file_over_450_lines_and_no_function_over_60_code_lines(path):
    source = path.read_text()
    assert source.count("\n") <= MAX_FILE_LINES, f"{path.name} has {source.count(chr(10))} lines"
    long = {name: size for name, size in function_code_lines(source).items() if size > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} code lines in {path.name}: {long}"


def test_every_conversion_module_says_what_it_owns():
    for path in (PACKAGE / "conversion").rglob("*.py"):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring, f"{path} has no docstring saying what it owns"


def _modules_loaded_by(statement: str) -> set:
    probe = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_the_command_imports_nothing_from_the_benchmark_library_and_conversion_no_matplotlib():
    loaded = _modules_loaded_by("import panther_lite.cli")
    assert not [name for name in loaded if name.startswith("panther_lite.benchmark")]
    assert "matplotlib" not in {name.split(".")[0] for name in _modules_loaded_by("import panther_lite.conversion")}
