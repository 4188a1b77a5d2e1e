"""Sweep sketched layers over a (num_terms × low_rank) grid against the dense layer.

One row per configuration plus a row for the dense baseline goes to
``DIR/<layer>_<dtype>.csv`` (appended and flushed as each finishes, so an interrupted
sweep keeps what it measured): parameter counts, forward and forward+backward times,
memory, relative output error of every init against a dense layer with a decaying
spectrum, speed-up and memory ratio against dense, speed-up against the anchor's
per-term formulation, the roofline fraction (CUDA), and with --task-accuracy the digits
test accuracy of a small model trained with each configuration. Plots:
``DIR/<layer>_<dtype>_heatmaps.png`` and ``DIR/<layer>_<dtype>_tradeoff.png``.

    python benchmarks/sweep.py                                  # CPU, 1024², batch 256, 4×4 grid
    python benchmarks/sweep.py --device cuda --dtype bfloat16 --in-features 8192 --out-features 8192 \\
        --batch-size 4096 --num-terms 1 2 4 --low-rank 16 32 64
    python benchmarks/sweep.py --layer conv2d                   # SKConv2d, 64 channels, 32² images, 3×3 grid
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from panther_lite.benchmark import Conv2dCase, LinearCase, plot_heatmaps, plot_tradeoff, run_sweep

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-layer defaults for the sizes and grid left unset (each CPU grid takes minutes on 2 cores).
DEFAULTS = {
    "linear": dict(in_features=1024, out_features=1024, batch_size=256, num_terms=[1, 2, 4, 8], low_rank=[8, 16, 32, 64]),
    "conv2d": dict(in_features=64, out_features=64, batch_size=8, num_terms=[1, 2, 4], low_rank=[2, 4, 8]),
}
SUMMARY_COLUMNS = [
    "method", "num_terms", "low_rank", "stored_params", "forward_ms", "forward_backward_ms", "speedup",
    "memory_ratio", "error_sketch", "error_svd", "anchor_speedup", "roofline_fraction", "task_accuracy",
]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", choices=sorted(DEFAULTS), default="linear")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--in-features", type=positive_int, help="in_features, or C_in for conv2d (default 1024 / 64)")
    parser.add_argument("--out-features", type=positive_int, help="out_features, or C_out for conv2d (default 1024 / 64)")
    parser.add_argument("--batch-size", type=positive_int, help="rows of the input (default 256 / 8 images)")
    parser.add_argument("--image-size", type=positive_int, default=32, help="conv2d: square image side")
    parser.add_argument("--kernel-size", type=positive_int, default=3, help="conv2d: square kernel side")
    parser.add_argument("--num-terms", type=positive_int, nargs="+", help="L values (default 1 2 4 8 / 1 2 4)")
    parser.add_argument("--low-rank", type=positive_int, nargs="+", help="k values (default 8 16 32 64 / 2 4 8)")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decay", type=float, default=1.0, help="the dense weight's singular values ~ i^-decay")
    parser.add_argument("--task-accuracy", action="store_true", help="also train a digits model per configuration")
    parser.add_argument("--task-width", type=positive_int, default=128, help="width of the digits model's middle layer")
    parser.add_argument("--task-epochs", type=positive_int, default=20)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/results/<device>")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.layer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.output_dir is None:
        args.output_dir = RESULTS / args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but CUDA is not available")
    return args


def make_case(args: argparse.Namespace):
    if args.layer == "linear":
        return LinearCase(args.in_features, args.out_features, args.batch_size)
    return Conv2dCase(args.in_features, args.out_features, args.batch_size, args.image_size, args.kernel_size)


def output_paths(args: argparse.Namespace):
    stem = args.output_dir / f"{args.layer}_{args.dtype}"
    return stem.with_suffix(".csv"), Path(f"{stem}_heatmaps.png"), Path(f"{stem}_tradeoff.png")


def main(argv=None) -> int:
    args = parse_args(argv)
    csv_path, heatmap_path, tradeoff_path = output_paths(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    csv_path.unlink(missing_ok=True)  # never re-plot a previous run's rows
    interrupted = False
    try:
        run_sweep(
            make_case(args),
            args.num_terms,
            args.low_rank,
            device=args.device,
            dtype=DTYPES[args.dtype],
            warmup=args.warmup,
            repeats=args.repeats,
            seed=args.seed,
            decay=args.decay,
            csv_path=csv_path,
            progress=not args.no_progress,
            task_accuracy=args.task_accuracy,
            task_width=args.task_width,
            task_epochs=args.task_epochs,
        )
    except KeyboardInterrupt:
        interrupted = True
        if not csv_path.exists():
            print("interrupted before the first row", file=sys.stderr)
            return 130
        print(f"interrupted: the rows measured so far are in {csv_path}", file=sys.stderr)
    df = pd.read_csv(csv_path)
    columns = [c for c in SUMMARY_COLUMNS if df[c].notna().any()]
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.precision", 4):
        print(df[columns].to_string(index=False))
    print(f"wrote {csv_path}")
    if (df["method"] == "sketched").any():
        for path in (plot_heatmaps(df, heatmap_path), plot_tradeoff(df, tradeoff_path)):
            print(f"wrote {path}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
