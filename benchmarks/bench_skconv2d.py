"""SKConv2d against nn.Conv2d at the same dtype: forward and forward+backward, NCHW and channels_last.

Grid (the anchor's): kernel 3/5/9 × image 64/128/256, every size configurable. Writes
``<output dir>/skconv2d_<dtype>.csv`` and ``.png`` (default output dir
``benchmarks/results/<device>``, as ``benchmarks/sweep.py``) with the median times, the
speed-up ``dense_ms / sketched_ms`` and the FLOP ratio it is bounded by. Forward rows
also time the anchor's per-term formulation of the same layer
(:func:`panther_lite.benchmark.anchor_conv2d`, ``2L`` convolutions whose outputs are
stacked and averaged): ``anchor_ms`` and ``anchor_speedup = anchor_ms / sketched_ms``
(empty for forward+backward: that formulation is a forward-only baseline).

    python benchmarks/bench_skconv2d.py                      # CPU, small default sizes
    python benchmarks/bench_skconv2d.py --device cuda --dtype bfloat16 --channels 256 --batch 16
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from panther_lite.benchmark import anchor_conv2d, device_name, ignore_size_warnings, time_callable  # noqa: E402
from panther_lite.nn import SKConv2d  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import non_negative_int, positive_int  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("forward", "forward+backward")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kernels", type=positive_int, nargs="+", default=[3, 5, 9])
    parser.add_argument("--images", type=positive_int, nargs="+", default=[64, 128, 256], help="square image sides")
    parser.add_argument("--channels", type=positive_int, default=32, help="C_in = C_out")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--num-terms", type=positive_int, default=1, help="L")
    parser.add_argument("--low-rank", type=positive_int, default=4, help="k (the layer has rank 2Lk)")
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/results/<device>")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or RESULTS / torch.device(args.device).type
    return args


def conv_flops(batch: int, out_hw: int, fan_in: int, fan_out: int) -> int:
    """Multiply-adds ×2 of one convolution producing ``batch × fan_out × out_hw`` outputs."""
    return 2 * batch * out_hw * fan_in * fan_out


def make_step(module, x: torch.Tensor, mode: str):
    """A callable running one forward (no autograd graph) or one forward+backward of
    ``module`` (an ``nn.Module``; for ``"forward"`` any callable of ``x``)."""
    if mode == "forward":

        def step():
            with torch.no_grad():
                return module(x)

        return step
    x = x.detach().requires_grad_()
    inputs = [x, *(p for p in module.parameters() if p.requires_grad)]
    with torch.no_grad():
        grad_out = torch.randn_like(module(x))

    def step():
        return torch.autograd.grad(module(x), inputs, grad_out)

    return step


def run(args: argparse.Namespace) -> pd.DataFrame:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    c, L, k = args.channels, args.num_terms, args.low_rank
    rows = []
    for kernel, image, channels_last in itertools.product(args.kernels, args.images, (False, True)):
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        dense = nn.Conv2d(c, c, kernel, padding="same", device=device, dtype=dtype)
        with ignore_size_warnings():  # large L·k on tiny convs store more than dense
            sketched = SKConv2d.from_conv2d(dense, L, k, init="sketch", seed=0)
        dense.to(memory_format=memory_format)
        sketched.to(memory_format=memory_format)
        anchor = anchor_conv2d(sketched)
        x = torch.randn(args.batch, c, image, image, device=device, dtype=dtype).to(memory_format=memory_format)
        fan_in = c * kernel * kernel
        dense_flops = conv_flops(args.batch, image * image, fan_in, c)
        sketch_flops = conv_flops(args.batch, image * image, fan_in, 2 * L * k) + conv_flops(
            args.batch, image * image, 2 * L * k, c
        )
        for mode in MODES:
            modules = {"dense": dense, "sketched": sketched, **({"anchor": anchor} if mode == "forward" else {})}
            times = {
                name: time_callable(make_step(module, x, mode), device=device, warmup=args.warmup, repeats=args.repeats)
                for name, module in modules.items()
            }
            anchor_ms = times.get("anchor", math.nan)
            rows.append(
                dict(
                    device=str(device),
                    device_name=device_name(device),
                    dtype=args.dtype,
                    batch=args.batch,
                    channels=c,
                    kernel=kernel,
                    image=image,
                    channels_last=channels_last,
                    mode=mode,
                    num_terms=L,
                    low_rank=k,
                    dense_ms=times["dense"],
                    sketched_ms=times["sketched"],
                    speedup=times["dense"] / times["sketched"],
                    flop_ratio=dense_flops / sketch_flops,
                    anchor_ms=anchor_ms,
                    anchor_speedup=anchor_ms / times["sketched"],
                )
            )
            anchor_text = "" if math.isnan(anchor_ms) else (
                f"  anchor {anchor_ms:9.3f} ms  anchor/SK {rows[-1]['anchor_speedup']:.2f}x"
            )
            print(
                f"k={kernel} img={image} cl={channels_last!s:5} {mode:16} dense {times['dense']:9.3f} ms  "
                f"sk {times['sketched']:9.3f} ms  speed-up {rows[-1]['speedup']:.2f}x "
                f"(FLOPs {rows[-1]['flop_ratio']:.2f}x){anchor_text}",
                flush=True,
            )
    return pd.DataFrame(rows)


def plot(frame: pd.DataFrame, path: Path) -> None:
    """Speed-up vs image size, one panel per (mode, memory format), one colour per kernel:
    over nn.Conv2d (measured and FLOP bound) and, for the forward, over the anchor."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True, squeeze=False)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    frame = run(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"skconv2d_{args.dtype}"
    frame.to_csv(stem.with_suffix(".csv"), index=False)
    plot(frame, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv and {stem}.png")


if __name__ == "__main__":
    main()
