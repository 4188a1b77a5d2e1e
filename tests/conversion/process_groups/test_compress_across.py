"""``compress_checkpoint`` across processes (gloo, in memory): rank 0 alone writes the output, the
same files (the same tensors within summation-order rounding) as one process; the streamed
pipeline across processes is refused naming ``in_memory``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from scenario import batches, tiny_llama  # noqa: E402

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def _tensors(directory: Path) -> dict:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(safetensors.load_file(str(path)))
    return found


def test_two_processes_write_the_one_process_checkpoint(tmp_path):
    import panther_lite

    source = tmp_path / "source"
    tiny_llama().save_pretrained(source)
    alone = tmp_path / "alone"
    panther_lite.compress_checkpoint(source, alone, calibration_data=batches(), in_memory=True, param_ratio=0.5,
                                     progress=False)
    across = tmp_path / "across"
    results = launch(2, dict(mode="compress", source=str(source), in_memory=True, param_ratio=0.5), across)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert sorted(p.name for p in across.iterdir()) == sorted(p.name for p in alone.iterdir())
    assert not list(tmp_path.glob(".*partial*"))
    expected, got = _tensors(alone), _tensors(across)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_streaming_across_processes_is_refused_naming_in_memory(tmp_path):
    source = tmp_path / "source"
    tiny_llama().save_pretrained(source)
    results = launch(2, dict(mode="compress", source=str(source), param_ratio=0.5), tmp_path / "out")
    for code, err in results:
        assert code != 0 and "in_memory=True" in err
    assert not (tmp_path / "out").exists()
