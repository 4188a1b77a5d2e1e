"""The command under ``torchrun --nproc-per-node 2`` (gloo on the CPU): the same output files as one
process, global allocation and sequential fits included (and block refinement), in memory; streamed, distilled
(``--distill``) as in one process; a run whose rank 1
dies leaves its work for ``--resume``, which finishes with the one-process output, rank 0 alone
printing the summary and evaluating (``--eval``)."""
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


@pytest.mark.parametrize("extra", [[], ["--refine", "--refine-max-steps", "3"]], ids=["fits", "refined"])
def test_torchrun_two_processes_write_the_one_process_model(extra, checkpoints, text_file, tmp_path):
    alone, across = tmp_path / "alone", tmp_path / "across"
    result = _compress([sys.executable], checkpoints["llama"], text_file, alone, *OPTIONS, *extra)
    assert result.returncode == 0, result.stderr
    result = _compress(TORCHRUN, checkpoints["llama"], text_file, across, *OPTIONS, *extra, "--collective-timeout", "300")
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in across.iterdir()) == sorted(p.name for p in alone.iterdir())
    expected, got = _tensors(alone), _tensors(across)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_torchrun_two_processes_distill_as_one_process(checkpoints, text_file, tmp_path):
    """``--distill`` streamed: each process caches its batches' teacher outputs and trains on them,
    every step the one-process step (tolerance: tests/conversion/process_groups/test_distillation.py)."""
    options = [option for option in OPTIONS if option != "--in-memory"] + ["--distill", "--distill-max-steps", "4"]
    alone, across = tmp_path / "alone", tmp_path / "across"
    result = _compress([sys.executable], checkpoints["llama"], text_file, alone, *options)
    assert result.returncode == 0, result.stderr
    result = _compress(TORCHRUN, checkpoints["llama"], text_file, across, *options, "--collective-timeout", "300")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "distillation.csv" in {p.name for p in across.iterdir()}
    assert sorted(p.name for p in across.iterdir()) == sorted(p.name for p in alone.iterdir())
    expected, got = _tensors(alone), _tensors(across)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


_DIE = """
import os
if os.environ.get("RANK") == os.environ.get("TEST_DIE_RANK"):  # rank 1 of the killed run: dies after block 0
    from panther_lite.conversion.process_groups.group import ProcessGroupRun
    barrier = ProcessGroupRun.barrier

    def dying(self, what):
        if "after block 1" in what:
            os._exit(3)
        return barrier(self, what)

    ProcessGroupRun.barrier = dying
"""


def test_torchrun_streamed_killed_rank_then_resume_gives_the_one_process_model(checkpoints, text_file, tmp_path):
    options = [option for option in OPTIONS if option != "--in-memory"]
    alone, across = tmp_path / "alone", tmp_path / "across"
    result = _compress([sys.executable], checkpoints["llama"], text_file, alone, *options)
    assert result.returncode == 0, result.stderr
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DIE)
    env = {**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "TEST_DIE_RANK": "1"}
    argv = ["compress", str(checkpoints["llama"]), "--calibration", str(text_file), "--output", str(across), *options]
    killed = subprocess.run([*TORCHRUN, "-m", "panther_lite", *argv, "--collective-timeout", "60"],
                            capture_output=True, text=True, cwd=ROOT, timeout=400, env=env)
    assert killed.returncode != 0 and not across.exists()
    assert (tmp_path / ".across.partial").is_dir()  # block 0 committed: kept for --resume
    result = _compress(TORCHRUN, checkpoints["llama"], text_file, across, *options, "--resume", "--eval", str(text_file))
    assert result.returncode == 0, result.stderr[-4000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("converted ")]
    assert len(summary) == 1 and result.stdout.count("perplexity on ") == 1, result.stdout  # rank 0 alone
    assert (across / "evaluation.csv").is_file() and not (tmp_path / ".across.partial").exists()
    expected, got = _tensors(alone), _tensors(across)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
