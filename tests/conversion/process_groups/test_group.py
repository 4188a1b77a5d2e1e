"""A rank that dies mid-run: the other ends with one clear error naming the exchange that failed,
within the collective timeout (no hang), and leaves no half-written output; a rerun finishes."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import launch  # noqa: E402
from scenario import tiny_llama  # noqa: E402

pytest.importorskip("transformers")

TIMEOUT = 20  # the collective timeout of this test's ranks, seconds
BOUND = 150  # process start-up (imports) and the conversion up to the failure included: a generous margin


def test_a_dead_rank_ends_the_run_with_a_clear_error_and_a_rerun_finishes(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    tiny_llama().save_pretrained(source)
    options = dict(mode="compress", source=str(source), in_memory=True, param_ratio=0.5)
    started = time.monotonic()
    results = launch(2, options, out, timeout=BOUND + 60,
                     extra_env={"TEST_DIE_RANK": "1", "TEST_COLLECTIVE_TIMEOUT": str(TIMEOUT)})
    assert time.monotonic() - started < BOUND
    (survivor_code, survivor_err), (dead_code, _) = results
    assert dead_code == 3
    assert survivor_code != 0
    assert "DistributedError: panther_lite: the all-gather of calibration Grams" in survivor_err
    assert "across 2 processes failed on rank 0" in survivor_err
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))
    results = launch(2, options, out, extra_env={"TEST_COLLECTIVE_TIMEOUT": "120"})
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert (out / "config.json").is_file()
