"""Performance bars: a sketched callable timed in alternation with its reference, the
median ratio and its spread against a required ratio, as rows, lines and a figure."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Union

import pandas as pd

from .environment import DeviceLike
from .timing import Spread, paired_ratio, time_interleaved

BAR_COLUMNS = (
    "bar", "device", "device_name", "dtype", "in_features", "out_features", "batch_size", "num_terms", "low_rank",
    "mode", "repeats", "sketched_ms", "sketched_iqr_ms", "reference", "reference_ms", "reference_iqr_ms",
    "measured", "measured_q1", "measured_q3", "measured_iqr", "required", "passed",
)  # fmt: skip
"""Columns of a bar row: ``measured`` is the median over rounds of reference time /
sketched time (higher is better), ``measured_q1``/``measured_q3`` its quartiles and
``measured_iqr`` their difference, ``repeats`` the number of rounds; ``passed`` is
``measured >= required``. Times are medians (ms), ``*_iqr_ms`` their interquartile ranges."""


def compare(
    sketched: Callable[[], object],
    reference: Callable[[], object],
    *,
    device: DeviceLike = "cpu",
    warmup: int = 3,
    repeats: int = 10,
) -> Dict[str, float]:
    """Time ``sketched`` and ``reference`` in alternation (:func:`time_interleaved`); returns
    the timing columns of :data:`BAR_COLUMNS` (medians, IQRs, the per-round ratio
    reference / sketched and its IQR, the number of rounds)."""
    samples = time_interleaved({"sketched": sketched, "reference": reference}, device=device, warmup=warmup,
                               repeats=repeats)  # fmt: skip
    sketched_ms, reference_ms = Spread.of(samples["sketched"]), Spread.of(samples["reference"])
    ratio = paired_ratio(samples["reference"], samples["sketched"])
    return dict(
        repeats=repeats, sketched_ms=sketched_ms.median, sketched_iqr_ms=sketched_ms.iqr,
        reference_ms=reference_ms.median, reference_iqr_ms=reference_ms.iqr,
        measured=ratio.median, measured_q1=ratio.q1, measured_q3=ratio.q3, measured_iqr=ratio.iqr,
    )  # fmt: skip


def bar_line(row) -> str:
    """One line saying whether a bar row (a mapping or a DataFrame row) passed, with its numbers."""
    verdict = "PASS" if row["passed"] else "MISS"
    return (
        f"{verdict} {row['bar']} ({row['in_features']}→{row['out_features']}, batch {row['batch_size']}, "
        f"L={row['num_terms']} k={row['low_rank']}, {row['mode']}): SK {row['sketched_ms']:.4g} ms, "
        f"{row['reference']} {row['reference_ms']:.4g} ms, ratio {row['measured']:.3g} "
        f"(IQR {row['measured_iqr']:.2g}, {row['repeats']} rounds; required {row['required']:.3g})"
    )


def plot_bars(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Each bar's measured ratio (median, with its quartiles as an error bar) beside the
    required one, one row per bar; saves a PNG at ``path`` and returns it."""
    from .plots import new_figure, save_figure

    fig = new_figure(figsize=(8, 1.2 + 0.6 * len(df)))
    ax = fig.subplots()
    positions = range(len(df))
    colours = ["tab:green" if passed else "tab:red" for passed in df["passed"]]  # a bar missed is red
    quartiles = [df["measured"] - df["measured_q1"], df["measured_q3"] - df["measured"]]
    ax.barh(positions, df["measured"], xerr=quartiles, color=colours, alpha=0.6, ecolor="dimgray", capsize=3,
            label="measured (median, quartiles)")  # fmt: skip
    ax.scatter(df["required"], positions, marker="D", s=30, color="black", zorder=3, label="required")
    labels = [f"{r.bar}\nL={r.num_terms} k={r.low_rank}, {r.mode}" for r in df.itertuples()]  # bars may share a name
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.set_xlabel("reference time / SKLinear time (×, higher is better)")
    ax.set_xlim(left=0)
    first = df.iloc[0]
    ax.set_title(f"{first['device_name']}, {first['dtype']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="x", alpha=0.3)
    return save_figure(fig, path)


def save_bars(rows, csv_path: Union[str, Path]) -> pd.DataFrame:
    """The bar ``rows`` (dicts) as a DataFrame with :data:`BAR_COLUMNS`, written as a CSV at
    ``csv_path`` (creating its folder) with :func:`plot_bars` beside it (``.png``)."""
    df = pd.DataFrame(list(rows), columns=list(BAR_COLUMNS))
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(csv_path, index=False)
    plot_bars(df, csv_path.with_suffix(".png"))
    return df
