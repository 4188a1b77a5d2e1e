"""The README as a new user follows it: every Python block runs as written, each on its own
(no name from another block), in a fresh directory; every ``compress`` command line in it is
one the command accepts. A block that must not run is marked by an HTML comment
``<!-- readme-test: skip (why) -->`` on the line before it (there is none today)."""
from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_SKIP = "<!-- readme-test: skip"


def blocks(language: str) -> list:
    """``[(line, code, skipped)]`` of the README's fenced blocks in ``language``."""
    text = README.read_text()
    found = []
    for match in _FENCE.finditer(text):
        if match.group(1) != language:
            continue
        before = text[: match.start()].rstrip().splitlines()
        skipped = bool(before) and before[-1].startswith(_SKIP)
        found.append((text.count("\n", 0, match.start()) + 2, match.group(2), skipped))
    return found


PYTHON = blocks("python")


def test_the_readme_has_its_python_blocks():
    assert len(PYTHON) >= 4 and not any(skipped for _, _, skipped in PYTHON)


@pytest.mark.parametrize("line, code, skipped", PYTHON, ids=[f"line {line}" for line, _, _ in PYTHON])
def test_a_readme_python_block_runs_as_written(line, code, skipped, tmp_path, monkeypatch, one_thread):
    if skipped:
        pytest.skip(f"README.md line {line} is marked {_SKIP}")
    for module in re.findall(r"^(?:from|import) (\w+)", code, re.M):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)  # blocks write "my-model" into the working directory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a README example that warns is a surprise
        warnings.filterwarnings("ignore", module="transformers|torchao|torch._dynamo")  # their own notes
        exec(compile(code, f"README.md block at line {line}", "exec"), {"__name__": "__readme__"})


def test_every_compress_command_line_in_the_readme_is_accepted(monkeypatch):
    from panther_lite.cli import build_parser

    lines = [" ".join(line.split()) for _, code, _ in blocks("bash") for line in code.replace("\\\n", " ").splitlines()
             if line.strip().startswith("python -m panther_lite compress")]  # fmt: skip
    assert lines, "the README shows the compress command"
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[3:])
        assert args.command == "compress" and args.param_ratio is not None
    headline = build_parser().parse_args(shlex.split(lines[0])[3:])
    assert (headline.allocation, headline.random_tokens) == ("global", 256)  # the recipe we recommend
