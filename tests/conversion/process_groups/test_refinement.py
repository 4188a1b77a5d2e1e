"""Block refinement across processes (gloo on the CPU): the held-back split is the one-process
split, the held-back errors the one-process sums, the gradients summed over the ranks, so two
processes refine to the one-process model within the rounding of the gradients' summation order;
a wrong setup is a ValueError on every rank."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from outcomes import across, assert_same, one_process  # noqa: E402

pytest.importorskip("transformers")

# Each rank's float32 gradients summed, then the ranks' sums added ((g0+g2)+g1 instead of
# (g0+g1)+g2): ~1e-7 relative per step, which Adam's normalised steps carry into the parameters
# at about lr times that; the fits before refinement differ by float64 summation-order rounding.
ATOL, RTOL = 1e-5, 1e-4
REFINE = dict(max_steps=4, lr=1e-3, patience=4)


@pytest.mark.parametrize("batches", [4, 2], ids=["split-calls", "rank-without-training-calls"])
def test_two_processes_refine_as_one_process(batches, tmp_path):
    options = dict(param_ratio=0.2, refine=REFINE, batches=batches)
    expected, got = one_process(options), across(2, options, tmp_path)
    assert_same(expected, got, ATOL, RTOL)
    alone, refined = expected[2], got["refinement"]
    assert [row["steps"] for row in refined] == [row["steps"] for row in alone]
    assert any(row["error_after"] < row["error_before"] for row in alone)  # the steps changed the blocks
    for mine, theirs in zip(refined, alone):
        for key in ("error_before", "error_after"):
            assert math.isclose(mine[key], theirs[key], rel_tol=RTOL)


def test_a_wrong_setup_is_a_clear_error_on_every_rank(tmp_path):
    out = tmp_path / "setups.pt"
    results = launch(2, dict(mode="refine setups"), out)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    found = torch.load(out)
    assert found["uneven calls"].startswith("ValueError") and "[1, 3] cached calls" in found["uneven calls"]
    assert "give [2, 2]" in found["uneven calls"]
    assert found["other parameters"].startswith("ValueError")
    assert "parameters of process 1 differ" in found["other parameters"]
