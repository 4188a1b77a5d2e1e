"""Fit time and error of the optimal low-rank conversion (issue 13, DESIGN.md §4): the exact
fit against the randomized range finder, and both against one exact SVD.

For each size ``n`` a trained-like ``n × n`` weight (:func:`panther_lite.benchmark.structured_weight`:
random orthonormal factors, singular values ``σ_i ∝ i^-decay``) is fitted at ``rank`` = 2Lk
with ``num_terms=1`` by :func:`panther_lite.nn.low_rank_fit.sketch_factors_from_weight`,
``method="exact"`` and ``method="randomized"``; with ``--gram`` also against a calibration
Gram ``XᵀX`` of inputs with decaying feature scales (the activation-aware fit). The fits
run in the dtype the layers use (:func:`~panther_lite.nn.low_rank_fit.decomposition_dtype`).
Times are medians over ``--repeats`` rounds, the three callables interleaved
(:func:`panther_lite.benchmark.time_interleaved`). Errors are relative Frobenius errors of
the fitted weight (of the outputs ``X Wᵀ`` with a Gram) against the optimal one: the
truncated SVD's (without a Gram) or the exact fit's (with one). The bar: at 4096, rank
512, the randomized fit ≥ 5× faster than one SVD with error ≤ 1.01× optimal.

Writes ``DIR/fit.csv`` and ``DIR/fit.png``; DIR defaults to ``benchmarks/out`` (git-ignored).

    python benchmarks/bench_fit.py                              # 4096², rank 512
    python benchmarks/bench_fit.py --sizes 512 1024 2048 --rank-fraction 0.125 --gram
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from panther_lite.benchmark import CsvRows, device_name, new_figure, save_figure, structured_weight, time_interleaved
from panther_lite.cli.arguments import non_negative_float, positive_int
from panther_lite.nn.low_rank_fit import decomposition_dtype, relative_error, sketch_factors_from_weight

OUT = Path(__file__).resolve().parent / "out"
COLUMNS = (
    "size", "rank", "decay", "gram", "dtype", "method", "median_s", "iqr_s", "repeats",
    "relative_error", "optimal_error", "error_ratio", "speedup_vs_svd", "threads", "device",
)
METHODS = ("svd", "exact", "randomized")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[4096], help="square weight sizes n")
    parser.add_argument("--rank", type=positive_int, default=512, help="fit rank 2Lk (default 512)")
    parser.add_argument("--rank-fraction", type=non_negative_float, default=None,
                        help="rank as a fraction of n instead of --rank (e.g. 0.125)")
    parser.add_argument("--decay", type=non_negative_float, default=0.5, help="spectrum decay exponent (default 0.5)")
    parser.add_argument("--gram", action="store_true", help="also fit against a calibration Gram")
    parser.add_argument("--repeats", type=positive_int, default=1, help="timed rounds per case (default 1)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads (default 1: stable timings on a shared machine)")
    parser.add_argument("--output-dir", type=Path, default=OUT, help=f"where fit.csv and fit.png go (default {OUT})")
    args = parser.parse_args(argv)
    for size in args.sizes:
        rank = rank_for(args, size)
        if not 1 <= rank < size:
            parser.error(f"rank {rank} must be between 1 and the size {size} - 1")
        if rank % 2:
            parser.error(f"rank {rank} must be even (2Lk with L=1)")
    return args


def rank_for(args, size: int) -> int:
    return args.rank if args.rank_fraction is None else 2 * max(1, round(args.rank_fraction * size / 2))


def calibration_gram(size: int, dtype: torch.dtype):
    """``(X, XᵀX)``: ``2n`` Gaussian inputs whose feature scales fall from 3 to 0.1."""
    x = torch.randn(2 * size, size, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x *= torch.linspace(3.0, 0.1, size, dtype=dtype)
    return x, x.t() @ x


def effective_weight(factors) -> torch.Tensor:
    S1, U1, U2, S2 = factors
    return ((S1 @ U1 + U2 @ S2) / 2).t()  # num_terms = 1: scale 1/2


def measure_case(size: int, rank: int, decay: float, with_gram: bool, repeats: int):
    """One row per method: timings and errors for one weight."""
    weight = structured_weight(size, size, decay=decay, seed=0, dtype=torch.float32)
    weight = weight.to(decomposition_dtype(weight))
    x, gram = calibration_gram(size, weight.dtype) if with_gram else (None, None)
    results = {}

    def fit(method):
        return lambda: results.__setitem__(method, sketch_factors_from_weight(weight, 1, rank // 2, gram, method=method))

    fns = {"svd": lambda: results.__setitem__("svd", torch.linalg.svd(weight, full_matrices=False)),
           "exact": fit("exact"), "randomized": fit("randomized")}
    samples = time_interleaved(fns, warmup=0, repeats=repeats)
    errors = {m: _fit_error(effective_weight(results[m]), weight, x) for m in ("exact", "randomized")}
    left, sigma, right = results["svd"]
    truncated = (left[:, :rank] * sigma[:rank]) @ right[:rank]
    errors["svd"] = _fit_error(truncated, weight, x)
    optimal = errors["exact"] if with_gram else errors["svd"]
    svd_s = statistics.median(samples["svd"]) / 1e3
    for method in METHODS:
        times = [t / 1e3 for t in samples[method]]
        quartiles = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
        yield {
            "size": size, "rank": rank, "decay": decay, "gram": with_gram, "dtype": str(weight.dtype).split(".")[-1],
            "method": method, "median_s": statistics.median(times), "iqr_s": quartiles[2] - quartiles[0],
            "repeats": repeats, "relative_error": errors[method], "optimal_error": optimal,
            "error_ratio": errors[method] / optimal, "speedup_vs_svd": svd_s / statistics.median(times),
            "threads": torch.get_num_threads(), "device": device_name("cpu"),
        }


def _fit_error(approx: torch.Tensor, weight: torch.Tensor, x) -> float:
    return relative_error(approx, weight) if x is None else relative_error(x @ approx.t(), x @ weight.t())


def plot(rows, path: Path) -> Path:
    """Time per method (log scale) and error ratio to the optimum, one group per case."""
    fig = new_figure(figsize=(10, 4))
    time_ax, error_ax = fig.subplots(1, 2)
    cases = sorted({(r["size"], r["rank"], r["gram"]) for r in rows})
    labels = [f"{n}², r={k}" + (", Gram" if g else "") for n, k, g in cases]
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        by_case = {(r["size"], r["rank"], r["gram"]): r for r in rows if r["method"] == method}
        positions = [c + (i - 1) * width for c in range(len(cases))]
        time_ax.bar(positions, [by_case[c]["median_s"] for c in cases], width, label=method)
        error_ax.bar(positions, [by_case[c]["error_ratio"] for c in cases], width, label=method)
    time_ax.set_yscale("log")
    time_ax.set_ylabel("seconds (median)")
    error_ax.axhline(1.01, color="red", linestyle="--", linewidth=1, label="bar: 1.01× optimal")
    error_ax.set_ylim(0.99, max(1.02, max(r["error_ratio"] for r in rows) * 1.005))
    error_ax.set_ylabel("error / optimal error")
    for ax in (time_ax, error_ax):
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, rotation=20)
        ax.legend()
    fig.suptitle(f"Low-rank fit: exact vs randomized ({rows[0]['device']})")
    return save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with CsvRows(args.output_dir / "fit.csv", COLUMNS) as csv_rows:
        for size in args.sizes:
            for with_gram in (False, True) if args.gram else (False,):
                for row in measure_case(size, rank_for(args, size), args.decay, with_gram, args.repeats):
                    csv_rows.write(row)
                    rows.append(row)
                    print(f"{size}² rank {row['rank']}{' gram' if with_gram else ''} {row['method']:>10}: "
                          f"{row['median_s']:.3f} s ({row['speedup_vs_svd']:.1f}x vs SVD), "
                          f"error {row['relative_error']:.5f} = {row['error_ratio']:.4f}x optimal", flush=True)
    print(f"wrote {args.output_dir / 'fit.csv'} and {plot(rows, args.output_dir / 'fit.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
