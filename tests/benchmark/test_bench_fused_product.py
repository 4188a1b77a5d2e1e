"""benchmarks/bench_fused_product.py: without a CUDA device it says what it needs; its figure draws
from rows; on a GPU (CUDA-marked) a small run writes both routes' rows, checked to agree first."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("matplotlib")


def test_without_a_gpu_it_says_what_it_needs(load_script, monkeypatch):
    bench = load_script("benchmarks/bench_fused_product.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device and Triton"):
        bench.main([])


def test_a_rank_beyond_the_kernel_is_refused_by_the_parser(load_script, capsys):
    bench = load_script("benchmarks/bench_fused_product.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--ranks", "64", "512"])
    assert "the kernel takes R <= 256, got 512" in capsys.readouterr().err


def test_the_figure_draws_both_routes_per_width_and_rows(load_script, tmp_path):
    bench = load_script("benchmarks/bench_fused_product.py")
    frame = pd.DataFrame([dict(width=w, rows=r, rank=k, two_gemms_roofline=0.6, fused_roofline=0.8)
                          for w in (4096, 8192) for r in (1, 4096) for k in (16, 64, 256)])
    bench.plot(frame, tmp_path / "fused.png", "test")
    assert (tmp_path / "fused.png").stat().st_size > 1000


@pytest.mark.cuda
def test_on_a_gpu_a_small_run_writes_both_routes(load_script, tmp_path):
    pytest.importorskip("triton")
    bench = load_script("benchmarks/bench_fused_product.py")
    bench.main(["--widths", "1024", "--ranks", "32", "--rows", "16", "512", "--repeats", "3",
                "--output-dir", str(tmp_path)])
    frame = pd.read_csv(tmp_path / "fused_product_bfloat16.csv")
    assert len(frame) == 2 and (frame["fused_ms"] > 0).all() and frame["device"].str.len().gt(0).all()
