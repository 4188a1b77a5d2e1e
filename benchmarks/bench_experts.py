"""SKExperts against the dense experts they replace (issue 29): forward and forward+backward
time over ranks, beside the FLOP ratio.

The dense experts are transformers' ``MixtralExperts`` at a scaled-down Mixtral shape (8
experts, top-2, hidden 1024, intermediate 2816 by default) run through each requested
experts implementation (``config._experts_implementation``: ``grouped_mm``, ``eager``,
``batched_mm``); :class:`panther_lite.nn.SKExperts` built from them (``init="sketch"``: the
values do not change the time) follows the same setting. Routing is fixed: ``--tokens``
tokens with seeded random router logits, top-``k``. For every rank (``L = --num-terms``,
``k`` in ``--ranks``, rank ``2Lk``) dense and sketched are timed in alternation
(:func:`panther_lite.benchmark.time_interleaved`, ``--threads`` CPU threads, 1 by default
for stable timings on a shared machine); each row has both medians with their
IQRs, the speed-up ``dense / sketched`` (median of the per-round ratios, with its IQR), the
FLOP ratio that bounds it — per routed row, dense ``6·hidden·inter``, sketched
``4Lk·(2·hidden + 3·inter)`` — and the stored-parameter ratio. Forward runs without
autograd; forward+backward computes the gradients of the input and of every trainable
parameter (the dense 3-D weights; the sketched ``S1``/``S2``).

Writes ``DIR/experts_<dtype>.csv`` and ``.png``; DIR defaults to ``benchmarks/out/<device>``
(git-ignored).

    python benchmarks/bench_experts.py                                   # Mixtral-scaled, CPU
    python benchmarks/bench_experts.py --ranks 32 64 --implementations grouped_mm --repeats 9
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    Spread,
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
from panther_lite.nn import SKExperts

OUT = Path(__file__).resolve().parent / "out"
MODES = ("forward", "forward+backward")
IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--top-k", type=positive_int, default=2)
    parser.add_argument("--hidden", type=positive_int, default=1024)
    parser.add_argument("--inter", type=positive_int, default=2816, help="intermediate size")
    parser.add_argument("--tokens", type=positive_int, default=512)
    parser.add_argument("--num-terms", type=positive_int, default=1, help="L")
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[16, 32, 64, 128], help="k values (rank 2Lk)")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=["grouped_mm", "eager"])
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads (default 1: stable timings on a shared machine)")
    parser.add_argument("--output-dir", type=Path, default=None, help="default: benchmarks/out/<device> (git-ignored)")
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    args.output_dir = args.output_dir or OUT / torch.device(args.device).type
    return args


class Routed(nn.Module):
    """An experts module with its routing fixed, so ``module(x)`` is one MoE experts call."""

    def __init__(self, experts: nn.Module, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        super().__init__()
        self.experts = experts
        self.top_k_index, self.top_k_weights = top_k_index, top_k_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.top_k_index, self.top_k_weights)


def dense_experts(args: argparse.Namespace, device, dtype):
    """``MixtralExperts`` with N(0, 0.02²) weights (the Mixtral init) and its config."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experts implementation is None" for a module outside a model
        experts = MixtralExperts(config).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(0.02 * torch.randn(weight.shape, generator=generator))
    return experts, config


def routing(args: argparse.Namespace, device, dtype):
    """``(x, top_k_index, top_k_weights)`` from seeded router logits."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(args.tokens, args.experts, generator=generator)
    weights, index = torch.topk(logits.softmax(-1), args.top_k)
    x = torch.randn(args.tokens, args.hidden, generator=generator)
    return x.to(device=device, dtype=dtype), index.to(device), weights.to(device=device, dtype=dtype)


def flop_ratio(hidden: int, inter: int, num_terms: int, low_rank: int) -> float:
    """Dense over sketched multiply-adds per routed row (gate_up and down projections)."""
    return 6 * hidden * inter / (4 * num_terms * low_rank * (2 * hidden + 3 * inter))


def timed(dense: nn.Module, sketched: nn.Module, x: torch.Tensor, mode: str, args) -> dict:
    """Dense and sketched in alternation: medians, IQRs and the per-round speed-up."""
    make = forward_step if mode == "forward" else forward_backward_step
    samples = time_interleaved(
        {"dense": make(dense, x), "sketched": make(sketched, x)}, device=x.device, warmup=args.warmup,
        repeats=args.repeats,
    )  # fmt: skip
    dense_ms, sketched_ms = Spread.of(samples["dense"]), Spread.of(samples["sketched"])
    speedup = paired_ratio(samples["dense"], samples["sketched"])
    return dict(
        repeats=args.repeats, dense_ms=dense_ms.median, dense_ms_iqr=dense_ms.iqr, sketched_ms=sketched_ms.median,
        sketched_ms_iqr=sketched_ms.iqr, speedup=speedup.median, speedup_iqr=speedup.iqr,
    )  # fmt: skip


def run(args: argparse.Namespace) -> pd.DataFrame:
    """Every rank, implementation and mode with ``args.threads`` CPU threads (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> pd.DataFrame:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    experts, config = dense_experts(args, device, dtype)
    x, index, weights = routing(args, device, dtype)
    dense = Routed(experts, index, weights)
    dense_params = sum(p.numel() for p in experts.parameters())
    rows = []
    for low_rank in args.ranks:
        with ignore_size_warnings():
            sketched_experts = SKExperts.from_experts(experts, args.num_terms, low_rank, init="sketch", seed=0)
        sketched = Routed(sketched_experts, index, weights)
        for implementation in args.implementations:
            config._experts_implementation = implementation  # shared: SKExperts follows it
            for mode in MODES:
                rows.append(dict(
                    device=str(device), device_name=device_name(device), dtype=args.dtype,
                    threads=torch.get_num_threads(), experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                    inter=args.inter, tokens=args.tokens, implementation=implementation, mode=mode,
                    num_terms=args.num_terms, low_rank=low_rank, rank=2 * args.num_terms * low_rank,
                    **timed(dense, sketched, x, mode, args),
                    flop_ratio=flop_ratio(args.hidden, args.inter, args.num_terms, low_rank),
                    stored_ratio=sketched_experts.parameter_counts().stored / dense_params,
                ))  # fmt: skip
                print(line(rows[-1]), flush=True)
    return pd.DataFrame(rows)


def line(row: dict) -> str:
    return (
        f"{row['implementation']:10} {row['mode']:16} 2Lk={row['rank']:4d} dense {row['dense_ms']:9.1f} ms  "
        f"sk {row['sketched_ms']:9.1f} ms  speed-up {row['speedup']:.2f}x (IQR {row['speedup_iqr']:.2f}; "
        f"FLOPs {row['flop_ratio']:.2f}x; stored {row['stored_ratio']:.3f})"
    )


def plot(frame: pd.DataFrame, path: Path) -> None:
    """Speed-up over the dense experts against rank 2Lk, one panel per mode, one colour per
    implementation (IQR as error bars), with the FLOP ratio that bounds it."""
    fig = new_figure(figsize=(10, 4.2))
    axes = fig.subplots(1, len(MODES), sharey=True, squeeze=False)[0]
    for ax, mode in zip(axes, MODES):
        panel = frame[frame["mode"] == mode]
        for index, (implementation, group) in enumerate(panel.groupby("implementation", sort=False)):
            ax.errorbar(group["rank"], group["speedup"], yerr=group["speedup_iqr"] / 2, fmt="o-", color=f"C{index}",
                        capsize=3, label=f"{implementation} measured")  # fmt: skip
        flops = panel.drop_duplicates("rank")
        ax.plot(flops["rank"], flops["flop_ratio"], "x--", color="gray", label="FLOP ratio")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(mode)
        ax.set_xlabel("rank 2Lk of every expert's projections")
        ax.set_ylabel("dense experts time / SKExperts time")
        ax.legend(fontsize=8)
    first = frame.iloc[0]
    fig.suptitle(
        f"SKExperts vs MixtralExperts on {first['device_name']} ({first['dtype']}): "
        f"{first['experts']} experts, top-{first['top_k']}, hidden {first['hidden']}, inter {first['inter']}, "
        f"{first['tokens']} tokens",
        fontsize=9,
    )
    save_figure(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    write_table_and_figure(run(args), args.output_dir / f"experts_{args.dtype}", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
