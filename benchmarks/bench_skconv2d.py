"""SKConv2d against nn.Conv2d at the same dtype: forward and forward+backward, NCHW and channels_last.

Grid (the anchor's): kernel 3/5/9 × image 64/128/256, every size configurable. Writes
``<output dir>/skconv2d_<dtype>.csv`` and ``.png`` (default output dir
``benchmarks/out/<device>``, git-ignored, as ``benchmarks/sweep.py``). Dense, sketched and
(forward only) the anchor's per-term formulation of the same layer
(:func:`panther_lite.benchmark.anchor_conv2d`, ``2L`` convolutions whose outputs are
stacked and averaged) are timed in alternation; each row has the median times, the
number of rounds (``repeats``), the speed-up ``dense / sketched`` (median of the
per-round ratios, ``speedup_iqr`` its IQR) beside the FLOP ratio that bounds it, and
``anchor_ms``, ``anchor_speedup`` = anchor / sketched with its IQR (empty for
forward+backward: that formulation is a forward-only baseline).

    python benchmarks/bench_skconv2d.py                      # CPU, small default sizes
    python benchmarks/bench_skconv2d.py --device cuda --dtype bfloat16 --channels 256 --batch 16
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    Conv2dCase,
    Spread,
    anchor_conv2d,
    device_name,
    forward_backward_step,
    forward_step,
    ignore_size_warnings,
    new_figure,
    paired_ratio,
    save_figure,
    time_interleaved,
    write_table_and_figure,
)
from panther_lite.cli.arguments import DTYPES, non_negative_int, positive_int
from panther_lite.nn import SKConv2d

OUT = Path(__file__).resolve().parent / "out"
MODES = ("forward", "forward+backward")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kernels", type=positive_int, nargs="+", default=[3, 5, 9])
    parser.add_argument("--images", type=positive_int, nargs="+", default=[64, 128, 256], help="square image sides")
    parser.add_argument("--channels", type=positive_int, default=32, help="C_in = C_out")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--num-terms", type=positive_int, default=1, help="L")
    parser.add_argument("--low-rank", type=positive_int, default=4, help="k (the layer has rank 2Lk)")
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/out/<device> (git-ignored)")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or OUT / torch.device(args.device).type
    return args


def layers(channels: int, kernel: int, num_terms: int, low_rank: int, channels_last: bool, device, dtype):
    """``nn.Conv2d(channels, channels, kernel, padding="same")``, its SKConv2d (random
    sketch of its kernel) and the anchor's per-term formulation, in the memory format asked."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    dense = nn.Conv2d(channels, channels, kernel, padding="same", device=device, dtype=dtype)
    with ignore_size_warnings():  # large L·k on tiny convs store more than dense
        sketched = SKConv2d.from_conv2d(dense, num_terms, low_rank, init="sketch", seed=0)
    dense.to(memory_format=memory_format)
    sketched.to(memory_format=memory_format)
    return dense, sketched, anchor_conv2d(sketched)


def timings(dense, sketched, anchor, x, mode: str, args: argparse.Namespace) -> dict:
    """Dense, sketched and (forward only) anchor timed in alternation: medians and the
    median per-round speed-ups with their IQRs."""
    if mode == "forward":
        steps = {"dense": forward_step(dense, x), "sketched": forward_step(sketched, x), "anchor": forward_step(anchor, x)}
    else:
        steps = {"dense": forward_backward_step(dense, x), "sketched": forward_backward_step(sketched, x)}
    samples = time_interleaved(steps, device=x.device, warmup=args.warmup, repeats=args.repeats)
    speedup = paired_ratio(samples["dense"], samples["sketched"])
    anchor = paired_ratio(samples["anchor"], samples["sketched"]) if "anchor" in samples else None
    return dict(
        repeats=args.repeats, dense_ms=Spread.of(samples["dense"]).median, sketched_ms=Spread.of(samples["sketched"]).median,
        speedup=speedup.median, speedup_iqr=speedup.iqr,
        anchor_ms=Spread.of(samples["anchor"]).median if anchor else math.nan,
        anchor_speedup=anchor.median if anchor else math.nan, anchor_speedup_iqr=anchor.iqr if anchor else math.nan,
    )  # fmt: skip


def run(args: argparse.Namespace) -> pd.DataFrame:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    c, L, k = args.channels, args.num_terms, args.low_rank
    rows = []
    for kernel, image, channels_last in itertools.product(args.kernels, args.images, (False, True)):
        dense, sketched, anchor = layers(c, kernel, L, k, channels_last, device, dtype)
        x = torch.randn(args.batch, c, image, image, device=device, dtype=dtype)
        x = x.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        case = Conv2dCase(c, c, args.batch, image, kernel)
        for mode in MODES:
            rows.append(dict(
                device=str(device), device_name=device_name(device), dtype=args.dtype, batch=args.batch, channels=c,
                kernel=kernel, image=image, channels_last=channels_last, mode=mode, num_terms=L, low_rank=k,
                **timings(dense, sketched, anchor, x, mode, args), flop_ratio=case.dense_flops() / case.sketch_flops(L, k),
            ))  # fmt: skip
            print(line(rows[-1]), flush=True)
    return pd.DataFrame(rows)


def line(row: dict) -> str:
    anchor = "" if math.isnan(row["anchor_ms"]) else f"  anchor {row['anchor_ms']:9.3f} ms  anchor/SK {row['anchor_speedup']:.2f}x"
    return (
        f"k={row['kernel']} img={row['image']} cl={row['channels_last']!s:5} {row['mode']:16} dense "
        f"{row['dense_ms']:9.3f} ms  sk {row['sketched_ms']:9.3f} ms  speed-up {row['speedup']:.2f}x "
        f"(IQR {row['speedup_iqr']:.2f}; FLOPs {row['flop_ratio']:.2f}x){anchor}"
    )


def plot(frame: pd.DataFrame, path: Path) -> None:
    """Speed-up vs image size, one panel per (mode, memory format), one colour per kernel:
    over nn.Conv2d (measured and FLOP bound) and, for the forward, over the anchor."""
    fig = new_figure(figsize=(10, 7))
    axes = fig.subplots(2, 2, sharex=True, squeeze=False)
    for row, mode in enumerate(MODES):
        for col, channels_last in enumerate((False, True)):
            ax = axes[row][col]
            panel = frame[(frame["mode"] == mode) & (frame["channels_last"] == channels_last)]
            for index, (kernel, group) in enumerate(panel.groupby("kernel")):
                color = f"C{index}"
                ax.plot(group["image"], group["speedup"], "o-", color=color, label=f"{kernel}×{kernel} measured")
                ax.plot(group["image"], group["flop_ratio"], "x--", color=color, alpha=0.6, label=f"{kernel}×{kernel} FLOPs")
                if group["anchor_speedup"].notna().any():
                    ax.plot(group["image"], group["anchor_speedup"], "s:", color=color, label=f"{kernel}×{kernel} vs anchor")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, {'channels_last' if channels_last else 'NCHW'}")
            ax.set_xlabel("image side")
            ax.set_ylabel("reference time / SKConv2d time")
            ax.legend(fontsize=7)
    first = frame.iloc[0]
    fig.suptitle(
        f"SKConv2d vs nn.Conv2d on {first['device_name']} ({first['dtype']}, batch {first['batch']}, "
        f"C={first['channels']}, L={first['num_terms']}, k={first['low_rank']})"
    )
    save_figure(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    write_table_and_figure(run(args), args.output_dir / f"skconv2d_{args.dtype}", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
