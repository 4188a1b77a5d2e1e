"""``python -m panther_lite compress`` never loses its inputs: an OUT_DIR that is, holds or lies
inside MODEL_DIR (or holds the calibration file) is refused before anything is written,
however the paths are spelled; SIGTERM cleans up as Ctrl-C does (nothing left before the first
block is written, the finished blocks kept for ``--resume`` after); OUT_DIR follows the umask."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from panther_lite.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--param-ratio", "0.5", "--fit", "exact", "--quiet", "--max-samples", "4"]
pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(root: Path) -> dict:
    """Every path under ``root``: a file's content hash, a link's target, or "dir"."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(root))] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[str(path.relative_to(root))] = "dir"
        else:
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def layout(tmp_path, checkpoints, text_file):
    """``root/models/gpt2`` (a copy of the tiny GPT-2), ``root/text.txt``, ``root/link`` -> the
    model directory, and ``root/cache``: a Hugging Face cache layout whose snapshot's files are
    links into ``root/cache/blobs``."""
    root = tmp_path / "root"
    model = root / "models" / "gpt2"
    shutil.copytree(checkpoints["gpt2"], model)
    shutil.copy(text_file, root / "text.txt")
    (root / "link").symlink_to(model, target_is_directory=True)
    blobs, snapshot = root / "cache" / "blobs", root / "cache" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for entry in model.iterdir():
        shutil.copy(entry, blobs / entry.name)
        (snapshot / entry.name).symlink_to(Path("..", "..", "blobs", entry.name))
    return root


# (MODEL_DIR, OUT_DIR, calibration file, words the message must hold), relative to root
SPELLINGS = {
    "OUT_DIR is MODEL_DIR's parent": ("models/gpt2", "models", "text.txt", "holds MODEL_DIR"),
    "OUT_DIR is MODEL_DIR's grandparent": ("models/gpt2", ".", "text.txt", "holds MODEL_DIR"),
    "OUT_DIR is MODEL_DIR": ("models/gpt2", "models/gpt2", "text.txt", "is MODEL_DIR"),
    "MODEL_DIR through a link, OUT_DIR its real path": ("link", "models/gpt2", "text.txt", "is MODEL_DIR"),
    "MODEL_DIR through a link, OUT_DIR the real parent": ("link", "models", "text.txt", "holds MODEL_DIR"),
    "OUT_DIR a link to MODEL_DIR": ("models/gpt2", "link", "text.txt", "is MODEL_DIR"),
    "OUT_DIR spelled with ..": ("models/gpt2", "models/gpt2/..", "text.txt", "holds MODEL_DIR"),
    "OUT_DIR through a link and ..": ("models/gpt2", "link/..", "text.txt", "holds MODEL_DIR"),
    "trailing slashes": ("models/gpt2/", "models/", "text.txt", "holds MODEL_DIR"),
    "OUT_DIR inside MODEL_DIR": ("models/gpt2", "models/gpt2/out", "text.txt", "inside it"),
    "OUT_DIR inside MODEL_DIR through a link": ("models/gpt2", "link/new/out", "text.txt", "inside it"),
    "OUT_DIR inside MODEL_DIR through ..": ("models/gpt2", "cache/../models/gpt2/out", "text.txt", "inside it"),
    "OUT_DIR holds the blobs MODEL_DIR's files link to": ("cache/snapshots/abc", "cache/blobs", "text.txt",
                                                          "MODEL_DIR's 'config.json'"),
    "OUT_DIR holds the calibration file only": ("cache/snapshots/abc", "models", "models/gpt2/config.json",
                                                "holds the calibration file"),
}


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("case", list(SPELLINGS))
def test_an_out_dir_that_is_holds_or_lies_inside_an_input_is_refused_and_nothing_is_touched(
    case, relative, layout, capsys, monkeypatch
):
    model, output, text, words = SPELLINGS[case]
    if relative:
        monkeypatch.chdir(layout)
        spell = str
    else:
        spell = lambda name: str(layout) + "/" + name  # noqa: E731  (keeps trailing slashes and ..)
    before = _tree(layout)
    argv = ["compress", spell(model), "--calibration", spell(text), "--output", spell(output), "--overwrite", *QUICK]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert _tree(layout) == before


def test_an_out_dir_beside_the_model_still_replaces_with_overwrite(layout, capsys):
    """The refusals above are not a refusal of everything: a sibling OUT_DIR is replaced."""
    output = layout / "models" / "small"
    output.mkdir()
    (output / "stale.txt").write_text("old")
    argv = ["compress", str(layout / "link"), "--calibration", str(layout / "text.txt"), "--output", str(output),
            "--overwrite", *QUICK]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert (output / "model.safetensors.index.json").is_file() and not (output / "stale.txt").exists()
    assert sorted(path.name for path in (layout / "models").iterdir()) == ["gpt2", "small"]


_DRIVER = """
import os, signal, sys
from panther_lite.cli import main
from panther_lite.conversion.pipelines import out_of_core
from panther_lite.conversion.saving.resume_state import RunState

signum = getattr(signal, os.environ["SIGNAL"])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits it ignored)
capture, commit = out_of_core.OutOfCore.capture, RunState.commit

def signalled_before_the_blocks(self, *args, **kwargs):
    os.kill(os.getpid(), signum)
    return capture(self, *args, **kwargs)

def signalled_after_the_first_block(self, *args, **kwargs):
    commit(self, *args, **kwargs)
    os.kill(os.getpid(), signum)

if os.environ["WHEN"] == "before the blocks":
    out_of_core.OutOfCore.capture = signalled_before_the_blocks
else:
    RunState.commit = signalled_after_the_first_block
sys.exit(main(sys.argv[1:]))
"""
STATUS = {"SIGTERM": 143, "SIGINT": 130}


def _run_signalled(argv, signal_name: str, when: str):
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SIGNAL": signal_name, "WHEN": when}
    return subprocess.run([sys.executable, "-c", _DRIVER, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=environment)


# each signal once, each against one state of OUT_DIR: the handler does not look at the directory,
# nor the cleanup at the signal, so the other two pairings add a minute of CPU and no path
@pytest.mark.parametrize("signal_name, existing", [("SIGTERM", False), ("SIGINT", True)],
                         ids=["SIGTERM-new", "SIGINT-replacing"])
def test_sigterm_cleans_up_as_ctrl_c_does(signal_name, existing, layout):
    output = layout / "fresh" / "out"
    if existing:
        output.mkdir(parents=True)
        (output / "keep.txt").write_text("mine")
    before = _tree(layout)
    argv = ["compress", str(layout / "models" / "gpt2"), "--calibration", str(layout / "text.txt"),
            "--output", str(output), "--overwrite", *QUICK]  # fmt: skip
    result = _run_signalled(argv, signal_name, "before the blocks")
    assert result.returncode == STATUS[signal_name], result.stderr
    assert "nothing was written" in result.stderr and "Traceback" not in result.stderr
    assert _tree(layout) == before  # no hidden .out.partial directory, no parent made for it

    result = _run_signalled(argv, signal_name, "after the first block")
    assert result.returncode == STATUS[signal_name] and "Traceback" not in result.stderr, result.stderr
    assert "run the same command with --resume" in result.stderr
    kept = {name: value for name, value in _tree(layout).items() if name not in before}
    assert all(name in ("fresh", "fresh/.out.partial") or name.startswith("fresh/.out.partial/") for name in kept)
    assert any(name.endswith(".safetensors") for name in kept)  # the first block, for --resume
    assert {name: before[name] for name in _tree(layout) if name in before} == before  # the inputs, OUT_DIR untouched
    assert main(argv + ["--resume"]) == 0
    assert (output / "model.safetensors.index.json").is_file() and not (output / "keep.txt").exists()
    assert sorted(path.name for path in output.parent.iterdir()) == ["out"]


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=oct)
def test_the_output_directory_follows_the_umask(umask, checkpoints, text_file, tmp_path):
    output = tmp_path / "made" / "out"
    previous = os.umask(umask)
    try:
        assert main(["compress", str(checkpoints["gpt2"]), "--calibration", str(text_file), "--output", str(output),
                     *QUICK]) == 0  # fmt: skip
    finally:
        os.umask(previous)
    expected = 0o777 & ~umask
    assert stat.S_IMODE(output.stat().st_mode) == expected
    assert stat.S_IMODE(output.parent.stat().st_mode) == expected
