"""The fused stacked product (one Triton kernel, ``panther_lite/nn/fused_product.py``) against the two
GEMMs the layer runs today, on a CUDA device: where does fusing pay, and how close does each come to
the memory roofline (issue 42)?

For each width (square ``in = out``), rank ``R = 2Lk`` and row count it times, interleaved in the same
rounds, the two GEMMs (``stacked_rows_forward``: ``x·[S1 | U2]`` then ``·[U1; S2]``) and the fused
kernel, with CUDA events and the L2 flushed before each call, and reports the median times, the
ratio two-GEMMs / fused with its interquartile spread, and each one's fraction of the roofline
(the device's measured GEMM peak and copy bandwidth: ``x``, the factors and ``y`` moved once).
Writes ``DIR/fused_product_<dtype>.csv`` and ``.png`` (DIR: ``benchmarks/out/cuda``, git-ignored;
``scripts/gpu_suite.sh fused`` writes ``benchmarks/results/cuda``).

    python benchmarks/bench_fused_product.py                       # bfloat16, widths 4096 and 8192
    python benchmarks/bench_fused_product.py --widths 4096 --ranks 32 64 --rows 16 4096
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pandas as pd
import torch

from panther_lite.benchmark import device_name, new_figure, paired_ratio, save_figure, time_interleaved
from panther_lite.benchmark.roofline import measure_device_peaks, roofline_ms
from panther_lite.cli.arguments import DTYPES, positive_int
from panther_lite.nn.functional import stacked_rows_forward
from panther_lite.nn.fused_product import LARGEST_RANK, fused_available, fused_stacked_product

OUT = Path(__file__).resolve().parent / "out" / "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--widths", type=positive_int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[16, 32, 64, 128, 256],
                        help=f"R = 2Lk, at most {LARGEST_RANK}")
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[1, 16, 4096])
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--output-dir", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if max(args.ranks) > LARGEST_RANK:
        parser.error(f"--ranks: the kernel takes R <= {LARGEST_RANK}, got {max(args.ranks)}")
    return args


def measure(width: int, rank: int, rows: int, dtype: torch.dtype, peaks, repeats: int) -> dict:
    """One configuration: both routes timed in the same rounds, checked to agree first."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, width, device="cuda", generator=generator).to(dtype)
    left = (torch.randn(width, rank, device="cuda", generator=generator) / width**0.5).to(dtype)
    right = (torch.randn(rank, width, device="cuda", generator=generator) / rank**0.5).to(dtype)
    bias = torch.zeros(width, device="cuda", dtype=dtype)
    routes = {"two GEMMs": lambda: stacked_rows_forward(x, left, right, bias, 0.5)[0],
              "fused": lambda: fused_stacked_product(x, left, right, bias, 0.5)}
    torch.testing.assert_close(routes["fused"](), routes["two GEMMs"](), rtol=2e-2, atol=2e-2)
    samples = time_interleaved(routes, device="cuda", warmup=5, repeats=repeats)
    size = torch.finfo(dtype).bits // 8
    least = roofline_ms(2.0 * rows * rank * 2 * width, size * (2 * rows * width + 2 * width * rank), peaks)
    ratio = paired_ratio(samples["two GEMMs"], samples["fused"])
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return dict(width=width, rank=rank, rows=rows, two_gemms_ms=medians["two GEMMs"], fused_ms=medians["fused"],
                speedup=ratio.median, speedup_q1=ratio.q1, speedup_q3=ratio.q3, roofline_ms=least,
                two_gemms_roofline=least / medians["two GEMMs"], fused_roofline=least / medians["fused"])


def plot(frame: pd.DataFrame, path: Path, title: str) -> None:
    """Per width and row count, both routes' fraction of the roofline over the rank."""
    groups = list(frame.groupby(["width", "rows"]))
    fig = new_figure(figsize=(4.2 * len(groups), 4))
    axes = fig.subplots(1, len(groups), sharey=True, squeeze=False)[0]
    for ax, ((width, rows), rows_frame) in zip(axes, groups):
        for column, label in (("two_gemms_roofline", "two GEMMs"), ("fused_roofline", "fused kernel")):
            ax.plot(rows_frame["rank"], rows_frame[column], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{width}² , {rows} rows", fontsize=9)
        ax.set_xlabel("rank R = 2Lk")
    axes[0].set_ylabel("fraction of the roofline")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() or not fused_available(torch.empty(0, device="cuda")):
        raise SystemExit("bench_fused_product needs a CUDA device and Triton")
    dtype = DTYPES[args.dtype]
    peaks = measure_device_peaks("cuda", dtype)
    rows = [measure(width, rank, count, dtype, peaks, args.repeats)
            for width in args.widths for count in args.rows for rank in args.ranks]
    frame = pd.DataFrame(rows).assign(dtype=args.dtype, device=device_name("cuda"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"fused_product_{args.dtype}"
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    title = f"fused stacked product against two GEMMs — {device_name('cuda')}, {args.dtype}"
    plot(frame, stem.with_suffix(".png"), title)
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
