"""Tutorial: choosing ``num_terms`` and ``low_rank`` with a parameter sweep.

A sketched layer's cost depends on ``L·k`` only, its accuracy on the init and the
spectrum of the weight it replaces. This script uses :mod:`panther_lite.benchmark` to

1. time a layer properly: warm-up, CUDA events on a GPU, and the layer in alternation
   with ``nn.Linear`` (:func:`~panther_lite.benchmark.compare`), so that other work on the
   machine slows both alike — the median ratio and its interquartile range;
2. count its memory: parameters, buffers and the activations saved for backward;
3. sweep an ``L × k`` grid against ``nn.Linear`` (and the anchor's per-term
   formulation), each configuration timed in alternation with the dense layer,
   collecting a DataFrame — and a CSV written row by row;
4. read the result: the cheapest configuration within an error budget, the Pareto
   front of error against time, and the heatmap and trade-off plots — from trustworthy
   timings only: a configuration whose timing spread (IQR) is large against its median
   was measured on a busy machine, and is flagged, hatched and never recommended.

    python tutorials/parameter_sweep.py --quick --output-dir /tmp/sweep   # seconds
    python tutorials/parameter_sweep.py --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

from panther_lite.benchmark import (
    LinearCase,
    compare,
    forward_step,
    noise_note,
    noisy_rows,
    pareto_front,
    parameter_bytes,
    plot_heatmaps,
    plot_tradeoff,
    run_sweep,
    saved_activation_bytes,
)
from panther_lite.nn import SKLinear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: runs in seconds")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--error-budget", type=float, default=0.3, help="largest acceptable relative output error")
    parser.add_argument("--output-dir", type=Path, default=Path("tutorial_outputs/parameter_sweep"))
    return parser.parse_args(argv)


def recommend(df, error_budget: float):
    """Print the fastest configuration within ``error_budget`` (init='svd') and the Pareto
    front, both from configurations whose timings are not noisy; warn on stderr about those
    left out. Returns the recommended row, or None."""
    sketched = df[df["method"] == "sketched"]
    shaky = noisy_rows(sketched)
    note = noise_note(df)
    if note is not None:
        print(f"warning: {note}", file=sys.stderr)
    within = sketched[~shaky & (sketched["error_svd"] <= error_budget)]
    best = None
    if within.empty:
        print(f"no configuration with a steady timing reaches error <= {error_budget} with init='svd'; widen the "
              "grid" + (" or re-measure the noisy ones" if shaky.any() else ""))  # fmt: skip
    else:
        best = within.sort_values("forward_ms").iloc[0]
        print(
            f"fastest with init='svd' and error <= {error_budget}: L={int(best['num_terms'])}, "
            f"k={int(best['low_rank'])} — {best['forward_ms']:.3f} ms (IQR {best['forward_iqr_ms']:.3f}), error "
            f"{best['error_svd']:.3f}, {best['stored_params']:,} stored parameters"
        )
    front = sketched[pareto_front(sketched["forward_ms"], sketched["error_svd"], excluded=shaky)]
    print("Pareto front (init='svd'):", ", ".join(f"L={int(r.num_terms)} k={int(r.low_rank)}" for r in front.itertuples()))
    return best


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.quick:
        case, grid, warmup, repeats = LinearCase(128, 96, 32), ([1, 2], [4, 8]), 1, 3
    else:
        case, grid, warmup, repeats = LinearCase(1024, 1024, 256), ([1, 2, 4], [8, 16, 32]), 3, 10
    args.output_dir.mkdir(parents=True, exist_ok=True)

    print("== 1. Timing ==")
    dense = nn.Linear(case.in_features, case.out_features, device=device, dtype=dtype)
    layer = SKLinear(case.in_features, case.out_features, 1, grid[1][-1], device=device, dtype=dtype, seed=0)
    x = torch.randn(case.batch_size, case.in_features, device=device, dtype=dtype)
    timings = compare(forward_step(layer, x), forward_step(dense, x), device=device, warmup=warmup, repeats=repeats)
    print(
        f"nn.Linear forward {timings['reference_ms']:.3f} ms, SKLinear(L=1, k={layer.low_rank}) forward "
        f"{timings['sketched_ms']:.3f} ms (medians of {repeats} alternating rounds): speed-up "
        f"{timings['measured']:.2f}x, IQR {timings['measured_iqr']:.2f}"
    )

    print("\n== 2. Memory ==")
    x.requires_grad_(True)
    for name, module in (("nn.Linear", dense), ("SKLinear", layer)):
        tensors = list(module.parameters()) + list(module.buffers())
        saved = saved_activation_bytes(lambda: module(x), tensors)
        print(f"{name}: {parameter_bytes(module):,} bytes of parameters and buffers, {saved:,} bytes saved for backward")

    print("\n== 3. Sweep ==")
    csv_path = args.output_dir / "sweep.csv"
    df = run_sweep(case, *grid, device=device, dtype=dtype, warmup=warmup, repeats=repeats, csv_path=csv_path)
    columns = ["method", "num_terms", "low_rank", "stored_params", "forward_ms", "speedup", "speedup_iqr", "error_sketch",
               "error_svd"]  # fmt: skip
    print(df[columns].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"rows written as measured to {csv_path}")

    print("\n== 4. Reading the result ==")
    recommend(df, args.error_budget)
    for path in (plot_heatmaps(df, args.output_dir / "heatmaps.png"), plot_tradeoff(df, args.output_dir / "tradeoff.png")):
        print(f"saved {path}")


if __name__ == "__main__":
    main()
