"""benchmarks/bench_experts.py at tiny sizes: every implementation, mode and rank gets a row
with paired timings, the FLOP and stored ratios it reports are the formulas', and a plot."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest


def test_bench_experts_times_every_implementation_mode_and_rank(tmp_path, capsys, load_script):
    pytest.importorskip("transformers")
    bench = load_script("benchmarks/bench_experts.py")
    argv = ["--experts", "4", "--hidden", "16", "--inter", "24", "--tokens", "6", "--ranks", "1", "2",
            "--implementations", "grouped_mm", "eager", "batched_mm", "--warmup", "0", "--repeats", "2",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    df = pd.read_csv(tmp_path / "experts_float32.csv")
    assert len(df) == 2 * 3 * 2 and set(df["mode"]) == set(bench.MODES)
    assert set(df["implementation"]) == {"grouped_mm", "eager", "batched_mm"}
    assert (df["repeats"] == 2).all() and (df["speedup_iqr"] >= 0).all() and (df["sketched_ms"] > 0).all()
    np.testing.assert_allclose(df["rank"], 2 * df["low_rank"])
    np.testing.assert_allclose(df["flop_ratio"], 6 * 16 * 24 / (4 * df["low_rank"] * (2 * 16 + 3 * 24)))
    stored = 2 * df["low_rank"] * 4 * ((16 + 48) + (24 + 16))  # 2Lk·(in+out) per expert and projection
    np.testing.assert_allclose(df["stored_ratio"], stored / (4 * (48 * 16 + 16 * 24)))
    assert capsys.readouterr().out.count("speed-up") == len(df)
    assert (tmp_path / "experts_float32.png").stat().st_size > 1000


def test_bench_experts_refuses_a_top_k_above_the_experts(load_script, capsys):
    bench = load_script("benchmarks/bench_experts.py")
    with pytest.raises(SystemExit):
        bench.parse_args(["--experts", "2", "--top-k", "3"])
    assert "--top-k 3 exceeds --experts 2" in capsys.readouterr().err
