"""The conversion report: one DataFrame row per selected layer, and its one-line summary
(pandas is imported only when a report is built)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List

from .fitting.layer import FitResult
from .records import CONVERTED, KEPT_DENSE, SKIPPED, LayerRecord

if TYPE_CHECKING:
    import pandas as pd

REPORT_COLUMNS = [
    "name",
    "kind",
    "shape",
    "status",
    "reason",
    "init",
    "num_terms",
    "low_rank",
    "dense_params",
    "trainable_params",
    "stored_params",
    "stored_ratio",
    "weight_error",
    "output_error",
    "calibration_rows",
    "shrinkage",
]

_FIT_FIGURES = (
    "init", "trainable_params", "stored_params", "weight_error", "output_error", "calibration_rows", "shrinkage"
)


def _part_fit(record: LayerRecord, part: LayerRecord, fit: "FitResult | None") -> "FitResult | None":
    """The fit figures of one part of ``record`` (the record's own for a one-matrix layer)."""
    if fit is None or part is record:
        return fit
    return fit.parts.get(part.name)


def _row(record: LayerRecord, fit: "FitResult | None") -> dict:
    dense = record.dense_params
    row = dict(
        name=record.name,
        kind=record.kind.name,
        shape=record.shape,
        status=record.status,
        reason=record.reason,
        init=None,
        num_terms=record.num_terms,
        low_rank=record.low_rank,
        dense_params=dense,
        trainable_params=dense,
        stored_params=dense,
        weight_error=math.nan,
        output_error=math.nan,
        calibration_rows=None,
        shrinkage=math.nan,
    )
    if fit is not None:
        row.update({figure: getattr(fit, figure) for figure in _FIT_FIGURES}, **fit.extra)
    row["stored_ratio"] = row["stored_params"] / dense if dense else math.nan
    return row


def build_report(
    records: List[LayerRecord], fits: Dict[str, FitResult], stored_before: int, stored_after: int
) -> "pd.DataFrame":
    """The report :func:`~panther_lite.convert` returns (columns :data:`REPORT_COLUMNS`, then
    any a kind adds, e.g. the per-expert figures of a mixture-of-experts projection); one row
    per part of each record (the layer itself, or each weight stack of a mixture-of-experts
    module); ``attrs`` holds the whole model's stored entries before/after and the summary line."""
    import pandas as pd

    rows = [_row(part, _part_fit(record, part, fits.get(record.name))) for record in records for part in record.parts]
    extra = [column for row in rows for column in row if column not in REPORT_COLUMNS]
    report = pd.DataFrame(rows, columns=REPORT_COLUMNS + list(dict.fromkeys(extra)))
    counts = [c for c in extra if all(isinstance(v, int) and not isinstance(v, bool) for v in report[c].dropna())]
    for column in ("num_terms", "low_rank", "calibration_rows", *dict.fromkeys(counts)):
        report[column] = report[column].astype("Int64")
    report.attrs["model_stored_before"] = stored_before
    report.attrs["model_stored_after"] = stored_after
    report.attrs["summary"] = conversion_summary(report)
    return report


def conversion_summary(report: "pd.DataFrame") -> str:
    """One printable line from a :func:`~panther_lite.convert` report: layers converted,
    and stored parameters (U buffers included) before → after for the selected layers and,
    when the report carries them, the whole model."""
    counts = report["status"].value_counts()
    converted = int(counts.get(CONVERTED, 0))
    before, after = int(report["dense_params"].sum()), int(report["stored_params"].sum())
    text = (
        f"converted {converted} of {len(report)} selected layers "
        f"({int(counts.get(KEPT_DENSE, 0))} kept dense, {int(counts.get(SKIPPED, 0))} skipped); "
        f"their stored parameters (U buffers included) {before:,} → {after:,} ({after / max(before, 1):.3f}x)"
    )
    if "model_stored_before" in report.attrs and "model_stored_after" in report.attrs:
        model_before, model_after = report.attrs["model_stored_before"], report.attrs["model_stored_after"]
        text += f"; whole model {model_before:,} → {model_after:,} ({model_after / max(model_before, 1):.3f}x)"
    return text
