"""What the multi-process ``convert`` tests compare: the model (and report) one process gives and
the one ``world`` ranks of ``worker.py`` give, equal within float64 summation-order rounding."""
from __future__ import annotations

from pathlib import Path

import torch

from launch import launch
from scenario import batches, tiny_llama

# float64 Grams summed per rank then across ranks ((b0+b2)+(b1+b3)) instead of batch by batch: the
# statistics differ in the last bits (~1e-16 relative), the fits by that times their conditioning.
ATOL, RTOL = 1e-5, 1e-4


def one_process(options: dict):
    """``(state dict, calibration rows, refinement rows)`` of ``convert`` in this process."""
    import panther_lite

    options = dict(options)
    model = tiny_llama(options.pop("model", "llama"))
    report = panther_lite.convert(model, calibration_data=batches(options.pop("batches", 4)), progress=False, **options)
    return model.state_dict(), report["calibration_rows"].fillna(-1).astype(int).tolist(), report.attrs.get("refinement")


def across(world: int, options: dict, tmp_path: Path, extra_env=None) -> dict:
    """What rank 0 of ``world`` ranks converting with ``options`` saved (``worker.py``)."""
    out = tmp_path / f"world{world}.pt"
    results = launch(world, options, out, extra_env=extra_env)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return torch.load(out)


def assert_same(expected, got: dict, atol: float = ATOL, rtol: float = RTOL) -> None:
    state, rows, _ = expected
    assert got["rows"] == rows  # every rank's rows counted once
    assert state.keys() == got["state"].keys()
    for name, tensor in state.items():
        torch.testing.assert_close(got["state"][name], tensor, atol=atol, rtol=rtol, msg=name)
