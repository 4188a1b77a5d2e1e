"""Sweep sketched layers over a (num_terms × low_rank) grid against the dense layer.

One row per configuration plus a row for the dense baseline goes to
``DIR/<layer>_<dtype>.csv`` (the columns are :data:`panther_lite.benchmark.SWEEP_COLUMNS`):
parameter counts, forward and forward+backward times (medians and IQRs, each
configuration timed in alternation with its own dense baseline), memory, relative output
error of every init against a dense layer with a decaying spectrum, speed-ups against
dense and against the anchor's per-term formulation (median and IQR of the per-round
ratios), the number of repeats, the roofline fraction (CUDA), and with --task-accuracy
the digits test accuracy of a small model trained with each configuration. Plots:
``DIR/<layer>_<dtype>_heatmaps.png`` and ``DIR/<layer>_<dtype>_tradeoff.png``.

DIR defaults to ``benchmarks/out/<device>`` (ignored by git); committing results is a
deliberate ``--output-dir benchmarks/results/<device>``. Every argument is checked before
any file is touched. Rows are written to a hidden staged CSV beside it as they are measured;
when the sweep ends or is interrupted (Ctrl-C keeps the rows measured) the plots are drawn
from those rows under staged names, and then the CSV and its plots replace the previous ones
as one unit (:func:`panther_lite.benchmark.publish_sweep_results`): even a second Ctrl-C
never leaves a plot of another run beside the CSV.

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

from panther_lite.benchmark import Conv2dCase, LinearCase, noise_note, publish_sweep_results, run_sweep, staged_path
from panther_lite.cli.arguments import DTYPES, non_negative_float, non_negative_int, positive_int

OUT = Path(__file__).resolve().parent / "out"
# Per-layer defaults for the sizes and grid left unset (each CPU grid takes minutes on 2 cores).
DEFAULTS = {
    "linear": dict(in_features=1024, out_features=1024, batch_size=256, num_terms=[1, 2, 4, 8], low_rank=[8, 16, 32, 64]),
    "conv2d": dict(in_features=64, out_features=64, batch_size=8, num_terms=[1, 2, 4], low_rank=[2, 4, 8]),
}
SUMMARY_COLUMNS = [
    "method", "num_terms", "low_rank", "stored_params", "repeats", "forward_ms", "forward_backward_ms", "speedup",
    "speedup_iqr", "memory_ratio", "error_sketch", "error_svd", "anchor_speedup", "roofline_fraction", "task_accuracy",
]  # fmt: skip


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
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed rounds")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed rounds; medians and IQRs are reported")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--decay", type=non_negative_float, default=1.0, help="the dense weight's singular values ~ i^-decay")
    parser.add_argument("--task-accuracy", action="store_true", help="also train a digits model per configuration")
    parser.add_argument("--task-width", type=positive_int, default=128, help="width of the digits model's middle layer")
    parser.add_argument("--task-epochs", type=positive_int, default=20)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/out/<device> (git-ignored)")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.layer].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.output_dir is None:
        args.output_dir = OUT / args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but CUDA is not available")
    for path in output_paths(args):
        if path.is_dir():
            parser.error(f"{path} is a directory: the sweep writes a file there (expected a file path or none)")
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
    case = make_case(args)
    csv_path, heatmap_path, tradeoff_path = output_paths(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    staged_csv = staged_path(csv_path)  # measured beside the CSV, then published with its plots
    staged_csv.unlink(missing_ok=True)
    measured, interrupted = [], False
    try:
        run_sweep(
            case, args.num_terms, args.low_rank, device=args.device, dtype=DTYPES[args.dtype], warmup=args.warmup,
            repeats=args.repeats, seed=args.seed, decay=args.decay, csv_path=staged_csv, progress=not args.no_progress,
            task_accuracy=args.task_accuracy, task_width=args.task_width, task_epochs=args.task_epochs,
            on_row=measured.append,
        )  # fmt: skip
    except KeyboardInterrupt:
        interrupted = True
        if not measured:
            print(f"interrupted before the first row: {args.output_dir} was left as it was", file=sys.stderr)
            return 130
        print(f"interrupted: the {len(measured)} rows measured so far replace {csv_path}", file=sys.stderr)
    df, lines = publish_sweep_results(staged_csv, csv_path, heatmap_path, tradeoff_path)
    columns = [c for c in SUMMARY_COLUMNS if df[c].notna().any()]
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.precision", 4):
        print(df[columns].to_string(index=False))
    print("\n".join(lines))
    note = noise_note(df)
    if note is not None:
        print(f"warning: {note}", file=sys.stderr)
    return 130 if interrupted or any(line.startswith("interrupted") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
