"""The host cost of one eager SKLinear call (DESIGN.md §4, issue 14): layers so small, or
inputs so short, that the time is Python and dispatch rather than arithmetic.

Each bar times SKLinear (in eval mode) in alternation with ``nn.Linear`` of the same shape
(:func:`panther_lite.benchmark.compare`, many short rounds) and compares the median
per-round ratio dense / SK (with its IQR) with the required one:

    tiny      64 → 64, 8 rows, L=1 k=8:                dense/SK >= 0.5 (SKLinear at most 2× nn.Linear's time)
    token     768 → 3072, 1 row, L=1 k=96 (rank 2Lk = 192): dense/SK >= 0.8 × the FLOP ratio (3.2×)
    token k192  the same at L=1 k=192 (rank 384):      dense/SK >= 0.8 × the FLOP ratio (1.6×)

each under ``torch.inference_mode()`` (the bar) and ``torch.no_grad()``. Prints one line
per bar and writes ``DIR/host_overhead.csv`` (columns
:data:`panther_lite.benchmark.BAR_COLUMNS`) and ``DIR/host_overhead.png``; DIR defaults to
``benchmarks/out/cpu`` (git-ignored).

    python benchmarks/bench_host_overhead.py
    python benchmarks/bench_host_overhead.py --repeats 200 --output-dir /tmp/host
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

from panther_lite.benchmark import LinearCase, bar_line, compare, device_name, forward_step, save_bars
from panther_lite.cli.arguments import non_negative_int, positive_int
from panther_lite.nn import SKLinear

OUT = Path(__file__).resolve().parent / "out"
# name: (in_features, out_features, rows, num_terms, low_rank, required as a multiple of 1 or of the FLOP ratio)
CASES = {
    "tiny": (64, 64, 8, 1, 8, ("fixed", 0.5)),
    "token": (768, 3072, 1, 1, 96, ("flop ratio", 0.8)),
    "token k192": (768, 3072, 1, 1, 192, ("flop ratio", 0.8)),
}
MODES = ("inference_mode", "no_grad")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=non_negative_int, default=100, help="untimed rounds")
    parser.add_argument("--repeats", type=positive_int, default=1000, help="timed rounds (SK and dense alternate)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a bar is missed")
    parser.add_argument("--output-dir", type=Path, default=OUT / "cpu", help="default: benchmarks/out/cpu (git-ignored)")
    return parser.parse_args(argv)


def measure(name: str, mode: str, warmup: int, repeats: int) -> dict:
    """One bar: ``CASES[name]`` under ``mode``, SKLinear against nn.Linear, fp32 on the CPU."""
    fan_in, fan_out, rows, num_terms, low_rank, (kind, factor) = CASES[name]
    case = LinearCase(fan_in, fan_out, rows)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        dense = nn.Linear(fan_in, fan_out).eval()
        x = torch.randn(rows, fan_in)
    sketched = SKLinear.from_linear(dense, num_terms, low_rank, init="sketch", seed=0).eval()  # speed: any init
    inference = mode == "inference_mode"
    timings = compare(forward_step(sketched, x, inference_mode=inference), forward_step(dense, x, inference_mode=inference),
                      warmup=warmup, repeats=repeats)  # fmt: skip
    required = factor * (case.dense_flops() / case.sketch_flops(num_terms, low_rank) if kind == "flop ratio" else 1.0)
    return dict(
        bar=f"{name}: dense/SK >= {factor}" + (" × FLOP ratio" if kind == "flop ratio" else ""),
        device="cpu", device_name=device_name("cpu"), dtype="float32", in_features=fan_in, out_features=fan_out,
        batch_size=rows, num_terms=num_terms, low_rank=low_rank, mode=mode, reference="nn.Linear", **timings,
        required=required, passed=bool(timings["measured"] >= required),
    )  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.output_dir / "host_overhead.csv"
    df = save_bars([measure(name, mode, args.warmup, args.repeats) for name in CASES for mode in MODES], path)
    print("\n".join(bar_line(row) for _, row in df.iterrows()))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 1 if args.strict and not df["passed"].all() else 0


if __name__ == "__main__":
    sys.exit(main())
