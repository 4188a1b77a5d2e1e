"""The SKLinear performance bars of DESIGN.md §4, measured in one run at one dtype.

Each bar times SKLinear against its reference — ``nn.Linear`` or the anchor's per-term
formulation — on the same input, and compares the measured ratio with the required one:

    CPU fp32, 4096², batch 256, L=1 k=64 forward:  dense/SK >= 0.7 × FLOP ratio (16×)
    CPU fp32, 4096², batch 256, L=8 k=32 forward:  anchor/SK >= 2
    CPU fp32, 4096², batch 256, L=2 k=64 fwd+bwd:  dense/SK >= 0.6 × FLOP ratio
    GPU bf16, 8192², 4096 tokens, L=1 k=16 forward: dense/SK >= 10
    GPU bf16, 8192², 4096 tokens, L × k grid (>= 1 GFLOP each): roofline/SK time >= 0.7

Prints one line per bar and writes ``DIR/sklinear_bars.csv``
(``benchmarks/bench_skconv2d.py`` is the SKConv2d counterpart).

    python benchmarks/bench_sklinear.py                    # CPU bars
    python benchmarks/bench_sklinear.py --device cuda      # GPU bars
    python benchmarks/bench_sklinear.py --features 256 --batch 32   # small sizes, same bars
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    LinearCase,
    anchor_linear,
    device_name,
    ignore_size_warnings,
    measure_device_peaks,
    roofline_ms,
    time_callable,
)
from panther_lite.nn import SKLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import non_negative_int, positive_int  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = [
    "bar", "device", "device_name", "dtype", "in_features", "out_features", "batch_size", "num_terms", "low_rank",
    "mode", "sketched_ms", "reference", "reference_ms", "measured", "required", "passed",
]
# Default (features, batch) of the bars per device, and the GPU roofline grid.
SIZES = {"cpu": (4096, 256), "cuda": (8192, 4096)}
ROOFLINE_GRID = [(L, k) for L in (1, 2, 4) for k in (16, 32, 64)]
MIN_ROOFLINE_FLOPS = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="which bars to measure")
    parser.add_argument("--features", type=positive_int, help="in = out features (default 4096 CPU / 8192 GPU)")
    parser.add_argument("--batch", type=positive_int, help="rows of the input (default 256 CPU / 4096 GPU)")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a bar is missed")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/results/<device>")
    args = parser.parse_args(argv)
    default_features, default_batch = SIZES[args.device]
    args.features = args.features or default_features
    args.batch = args.batch or default_batch
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but CUDA is not available")
    args.output_dir = args.output_dir or RESULTS / args.device
    return args


class Bench:
    """One device, dtype and input shared by every bar of a run."""

    def __init__(self, device: str, dtype: torch.dtype, features: int, batch: int, warmup: int, repeats: int):
        self.device, self.dtype, self.warmup, self.repeats = torch.device(device), dtype, warmup, repeats
        self.case = LinearCase(features, features, batch)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, features, generator=generator).to(self.device, dtype)
        self.x_grad = self.x.clone().requires_grad_(True)
        self.grad_out = torch.randn(batch, features, generator=generator).to(self.device, dtype)
        with torch.random.fork_rng(devices=[]):  # drawn on the CPU: the same layer on every device
            torch.default_generator.manual_seed(0)
            self.dense = nn.Linear(features, features, dtype=dtype).to(self.device)

    def layer(self, num_terms: int, low_rank: int) -> SKLinear:
        f = self.case.in_features
        with ignore_size_warnings():
            return SKLinear(f, f, num_terms, low_rank, device=self.device, dtype=self.dtype, seed=0)

    def forward_ms(self, fn) -> float:
        def run() -> None:
            with torch.no_grad():
                fn(self.x)

        return time_callable(run, device=self.device, warmup=self.warmup, repeats=self.repeats)

    def forward_backward_ms(self, module: nn.Module) -> float:
        def run() -> None:
            module.zero_grad(set_to_none=True)
            self.x_grad.grad = None
            module(self.x_grad).backward(self.grad_out)

        return time_callable(run, device=self.device, warmup=self.warmup, repeats=self.repeats)

    def flop_ratio(self, num_terms: int, low_rank: int) -> float:
        return self.case.dense_flops() / self.case.sketch_flops(num_terms, low_rank)

    def row(self, bar, num_terms, low_rank, mode, sketched_ms, reference, reference_ms, measured, required):
        return dict(
            bar=bar, device=str(self.device), device_name=device_name(self.device),
            dtype=str(self.dtype).removeprefix("torch."), in_features=self.case.in_features,
            out_features=self.case.out_features, batch_size=self.case.batch_size, num_terms=num_terms,
            low_rank=low_rank, mode=mode, sketched_ms=sketched_ms, reference=reference, reference_ms=reference_ms,
            measured=measured, required=required, passed=bool(measured >= required),
        )

    def dense_ratio_bar(self, bar: str, num_terms: int, low_rank: int, mode: str, fraction: float) -> dict:
        """dense time / SK time against ``fraction`` × the FLOP ratio."""
        layer = self.layer(num_terms, low_rank)
        if mode == "forward":
            sk, dense = self.forward_ms(layer), self.forward_ms(self.dense)
        else:
            sk, dense = self.forward_backward_ms(layer), self.forward_backward_ms(self.dense)
        required = fraction * self.flop_ratio(num_terms, low_rank)
        return self.row(bar, num_terms, low_rank, mode, sk, "nn.Linear", dense, dense / sk, required)

    def anchor_bar(self, bar: str, num_terms: int, low_rank: int, required: float) -> dict:
        """anchor forward time / SK forward time against ``required``."""
        layer = self.layer(num_terms, low_rank)
        sk, anchor = self.forward_ms(layer), self.forward_ms(anchor_linear(layer))
        return self.row(bar, num_terms, low_rank, "forward", sk, "anchor", anchor, anchor / sk, required)

    def speedup_bar(self, bar: str, num_terms: int, low_rank: int, required: float) -> dict:
        """dense forward time / SK forward time against a fixed ``required``."""
        layer = self.layer(num_terms, low_rank)
        sk, dense = self.forward_ms(layer), self.forward_ms(self.dense)
        return self.row(bar, num_terms, low_rank, "forward", sk, "nn.Linear", dense, dense / sk, required)

    def roofline_bars(self, required: float) -> list:
        """roofline time / SK forward time for every grid config of >= 1 GFLOP."""
        peaks = measure_device_peaks(self.device, self.dtype)
        rows = []
        for num_terms, low_rank in ROOFLINE_GRID:
            flops = self.case.sketch_flops(num_terms, low_rank)
            if flops < MIN_ROOFLINE_FLOPS:
                continue
            bytes_moved = self.case.sketch_bytes(num_terms, low_rank, self.x.element_size())
            limit = roofline_ms(flops, bytes_moved, peaks)
            sk = self.forward_ms(self.layer(num_terms, low_rank))
            rows.append(
                self.row("GPU roofline", num_terms, low_rank, "forward", sk, "roofline", limit, limit / sk, required)
            )
        return rows


def run_bars(args: argparse.Namespace) -> pd.DataFrame:
    if args.device == "cpu":
        bench = Bench("cpu", torch.float32, args.features, args.batch, args.warmup, args.repeats)
        rows = [
            bench.dense_ratio_bar("CPU L=1 k=64 forward vs dense", 1, 64, "forward", 0.7),
            bench.anchor_bar("CPU L=8 k=32 forward vs anchor", 8, 32, 2.0),
            bench.dense_ratio_bar("CPU L=2 k=64 fwd+bwd vs dense", 2, 64, "forward+backward", 0.6),
        ]
    else:
        bench = Bench("cuda", torch.bfloat16, args.features, args.batch, args.warmup, args.repeats)
        rows = [bench.speedup_bar("GPU L=1 k=16 forward vs dense", 1, 16, 10.0), *bench.roofline_bars(0.7)]
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv=None) -> int:
    args = parse_args(argv)
    df = run_bars(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "sklinear_bars.csv"
    df.to_csv(path, index=False)
    for row in df.itertuples():
        verdict = "PASS" if row.passed else "MISS"
        print(
            f"{verdict} {row.bar} ({row.in_features}², batch {row.batch_size}, L={row.num_terms} k={row.low_rank}): "
            f"SK {row.sketched_ms:.3f} ms, {row.reference} {row.reference_ms:.3f} ms, "
            f"ratio {row.measured:.2f} (required {row.required:.2f})"
        )
    print(f"wrote {path}")
    return 1 if args.strict and not df["passed"].all() else 0


if __name__ == "__main__":
    sys.exit(main())
