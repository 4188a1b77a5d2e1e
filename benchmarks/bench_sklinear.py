"""The SKLinear performance bars of DESIGN.md §4, measured in one run at one dtype.

Each bar times SKLinear in alternation with its reference — ``nn.Linear`` or the anchor's
per-term formulation — on the same input (:func:`panther_lite.benchmark.compare`), and
compares the median per-round ratio (with its IQR) with the required one:

    CPU fp32, 4096², batch 256, L=1 k=64 forward:  dense/SK >= 0.7 × FLOP ratio (16×)
    CPU fp32, 4096², batch 256, L=8 k=32 forward:  anchor/SK >= 2
    CPU fp32, 4096², batch 256, L=2 k=64 fwd+bwd:  dense/SK >= 0.6 × FLOP ratio
    GPU bf16, 8192², 4096 tokens, L=1 k=16 forward: dense/SK >= 10
    GPU bf16, 8192², 4096 tokens, L × k grid (>= 1 GFLOP each): roofline/SK time >= 0.7

Prints one line per bar and writes ``DIR/sklinear_bars.csv`` (columns
:data:`panther_lite.benchmark.BAR_COLUMNS`) and ``DIR/sklinear_bars.png``; DIR defaults to
``benchmarks/out/<device>`` (git-ignored). ``benchmarks/bench_skconv2d.py`` is the SKConv2d
counterpart, ``benchmarks/bench_host_overhead.py`` the small-layer (host cost) bars.

    python benchmarks/bench_sklinear.py                    # CPU bars
    python benchmarks/bench_sklinear.py --device cuda      # GPU bars
    python benchmarks/bench_sklinear.py --features 256 --batch 32   # small sizes, same bars
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

from panther_lite.benchmark import (
    LinearCase,
    Spread,
    anchor_linear,
    bar_line,
    compare,
    device_name,
    forward_backward_step,
    forward_step,
    ignore_size_warnings,
    measure_device_peaks,
    roofline_ms,
    save_bars,
    time_interleaved,
)
from panther_lite.cli.arguments import non_negative_int, positive_int
from panther_lite.nn import SKLinear

OUT = Path(__file__).resolve().parent / "out"
# Default (features, batch) of the bars per device, and the GPU roofline grid.
SIZES = {"cpu": (4096, 256), "cuda": (8192, 4096)}
ROOFLINE_GRID = [(L, k) for L in (1, 2, 4) for k in (16, 32, 64)]
MIN_ROOFLINE_FLOPS = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="which bars to measure")
    parser.add_argument("--features", type=positive_int, help="in = out features (default 4096 CPU / 8192 GPU)")
    parser.add_argument("--batch", type=positive_int, help="rows of the input (default 256 CPU / 4096 GPU)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed rounds")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed rounds (SK and reference alternate)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a bar is missed")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/out/<device> (git-ignored)")
    args = parser.parse_args(argv)
    default_features, default_batch = SIZES[args.device]
    args.features = args.features or default_features
    args.batch = args.batch or default_batch
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but CUDA is not available")
    args.output_dir = args.output_dir or OUT / args.device
    return args


class Bench:
    """One device, dtype and input shared by every bar of a run."""

    def __init__(self, device: str, dtype: torch.dtype, features: int, batch: int, warmup: int, repeats: int):
        self.device, self.dtype, self.warmup, self.repeats = torch.device(device), dtype, warmup, repeats
        self.case = LinearCase(features, features, batch)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, features, generator=generator).to(self.device, dtype)
        with torch.random.fork_rng(devices=[]):  # drawn on the CPU: the same layer on every device
            torch.default_generator.manual_seed(0)
            self.dense = nn.Linear(features, features, dtype=dtype).to(self.device)

    def layer(self, num_terms: int, low_rank: int) -> SKLinear:
        f = self.case.in_features
        with ignore_size_warnings():
            return SKLinear(f, f, num_terms, low_rank, device=self.device, dtype=self.dtype, seed=0)

    def step(self, module, mode: str):
        return forward_step(module, self.x) if mode == "forward" else forward_backward_step(module, self.x)

    def row(self, bar: str, num_terms: int, low_rank: int, mode: str, reference: str, timings: dict, required: float):
        return dict(
            bar=bar, device=str(self.device), device_name=device_name(self.device),
            dtype=str(self.dtype).removeprefix("torch."), in_features=self.case.in_features,
            out_features=self.case.out_features, batch_size=self.case.batch_size, num_terms=num_terms,
            low_rank=low_rank, mode=mode, reference=reference, **timings, required=required,
            passed=bool(timings["measured"] >= required),
        )  # fmt: skip

    def against(self, bar: str, num_terms: int, low_rank: int, mode: str, reference: str, required: float) -> dict:
        """SKLinear(L, k) against ``reference`` ("nn.Linear" or "anchor", whose
        formulation is forward-only) in ``mode``, with the ratio required."""
        layer = self.layer(num_terms, low_rank)
        other = self.dense if reference == "nn.Linear" else anchor_linear(layer)
        timings = compare(self.step(layer, mode), self.step(other, mode), device=self.device, warmup=self.warmup,
                          repeats=self.repeats)  # fmt: skip
        return self.row(bar, num_terms, low_rank, mode, reference, timings, required)

    def flop_ratio(self, num_terms: int, low_rank: int) -> float:
        return self.case.dense_flops() / self.case.sketch_flops(num_terms, low_rank)

    def roofline_bars(self, required: float) -> list:
        """roofline time / SK forward time for every grid config of >= 1 GFLOP."""
        peaks = measure_device_peaks(self.device, self.dtype)
        rows = []
        for num_terms, low_rank in ROOFLINE_GRID:
            flops = self.case.sketch_flops(num_terms, low_rank)
            if flops < MIN_ROOFLINE_FLOPS:
                continue
            limit = roofline_ms(flops, self.case.sketch_bytes(num_terms, low_rank, self.x.element_size()), peaks)
            samples = time_interleaved({"sk": self.step(self.layer(num_terms, low_rank), "forward")},
                                       device=self.device, warmup=self.warmup, repeats=self.repeats)["sk"]  # fmt: skip
            sk, ratio = Spread.of(samples), Spread.of([limit / sample for sample in samples])
            timings = dict(repeats=self.repeats, sketched_ms=sk.median, sketched_iqr_ms=sk.iqr, reference_ms=limit,
                           reference_iqr_ms=0.0, measured=ratio.median, measured_q1=ratio.q1, measured_q3=ratio.q3,
                           measured_iqr=ratio.iqr)  # fmt: skip
            rows.append(self.row("GPU roofline", num_terms, low_rank, "forward", "roofline", timings, required))
        return rows


def run_bars(args: argparse.Namespace) -> list:
    if args.device == "cpu":
        bench = Bench("cpu", torch.float32, args.features, args.batch, args.warmup, args.repeats)
        rows = [
            bench.against("CPU L=1 k=64 vs dense", 1, 64, "forward", "nn.Linear", 0.7 * bench.flop_ratio(1, 64)),
            bench.against("CPU L=8 k=32 vs anchor", 8, 32, "forward", "anchor", 2.0),
            bench.against("CPU L=2 k=64 vs dense", 2, 64, "forward+backward", "nn.Linear", 0.6 * bench.flop_ratio(2, 64)),
        ]  # fmt: skip
    else:
        bench = Bench("cuda", torch.bfloat16, args.features, args.batch, args.warmup, args.repeats)
        rows = [bench.against("GPU L=1 k=16 vs dense", 1, 16, "forward", "nn.Linear", 10.0), *bench.roofline_bars(0.7)]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    path = args.output_dir / "sklinear_bars.csv"
    df = save_bars(run_bars(args), path)
    print("\n".join(bar_line(row) for _, row in df.iterrows()))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 1 if args.strict and not df["passed"].all() else 0


if __name__ == "__main__":
    sys.exit(main())
