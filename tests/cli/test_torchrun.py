"""The command under ``torchrun --nproc-per-node 2`` (gloo on the CPU, in memory): the same output
files as one process, global allocation and sequential fits included; the streamed pipeline
across processes is refused naming ``--in-memory``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
safetensors = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ["--param-ratio", "0.5", "--allocation", "global", "--sequential", "--seed", "0", "--max-samples", "16",
           "--batch-size", "4", "--seq-len", "8", "--in-memory", "--quiet"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _compress(launcher: list, model_dir: Path, text_file: Path, output: Path, *extra) -> subprocess.CompletedProcess:
    argv = ["compress", str(model_dir), "--calibration", str(text_file), "--output", str(output), *extra]
    return subprocess.run([*launcher, "-m", "panther_lite", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=400, env=ENV)


def _tensors(directory: Path) -> dict:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(safetensors.load_file(str(path)))
    return found


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_torchrun_two_processes_write_the_one_process_model(checkpoints, text_file, tmp_path):
    alone, across = tmp_path / "alone", tmp_path / "across"
    result = _compress([sys.executable], checkpoints["llama"], text_file, alone, *OPTIONS)
    assert result.returncode == 0, result.stderr
    result = _compress(TORCHRUN, checkpoints["llama"], text_file, across, *OPTIONS, "--collective-timeout", "300")
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in across.iterdir()) == sorted(p.name for p in alone.iterdir())
    expected, got = _tensors(alone), _tensors(across)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_torchrun_without_in_memory_is_refused_naming_it(checkpoints, text_file, tmp_path):
    options = [option for option in OPTIONS if option != "--in-memory"]
    result = _compress(TORCHRUN, checkpoints["llama"], text_file, tmp_path / "out", *options)
    assert result.returncode != 0 and "in_memory=True (--in-memory" in result.stderr
    assert not (tmp_path / "out").exists()
