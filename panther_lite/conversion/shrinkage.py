"""Shrinkage of calibration second moments towards their diagonal, with a strength estimated
from the data itself (Ledoit–Wolf), so statistics from a few calibration rows generalise.

A Gram ``G = XᵀX`` of ``n`` rows ``x_i`` estimates ``n·E[xxᵀ]``. Its off-diagonal entries
are noisy when ``n`` is not large against ``fan_in`` (and singular when ``n < fan_in``): the
activation-aware fit then spends rank on directions the calibration rows happen to
correlate and that other data does not. The shrunk Gram

    G_α = (1 − α)·G + α·diag(G)

keeps every input's own scale and damps the correlations by ``α``, chosen to minimise the
expected squared error of ``G_α/n`` against the true second moment (Ledoit & Wolf 2004,
with the diagonal target of Schäfer & Strimmer 2005). With ``S = G/n``,

    α = Σ_{j≠k} Var(S_jk) / Σ_{j≠k} S_jk²,
    Σ_{j≠k} Var(S_jk) ≈ ( (1/n)·Σ_i (‖x_i‖⁴ − Σ_j x_ij⁴) − Σ_{j≠k} S_jk² ) / n,

clamped to ``[0, 1]``. The only extra statistics are two scalars per Gram, ``Σ_i ‖x_i‖⁴``
and ``Σ_ij x_ij⁴`` (:class:`RowMoments`), accumulated beside it: ``α`` falls like
``fan_in/n`` as rows accumulate and is near 1 when they are fewer than the inputs.
The estimate treats rows as independent; tokens of one sequence are not, so it errs on the
side of too little shrinkage.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .layer_record import LayerRecord

__all__ = ["RowMoments", "shrinkage_intensity", "shrink", "note_few_rows"]


class RowMoments:
    """The count of rows a Gram accumulated, ``Σ_i ‖x_i‖⁴`` and ``Σ_ij x_ij⁴`` (float64
    tensors on the rows' device, so accumulating never synchronises)."""

    def __init__(self) -> None:
        self.rows = 0
        self.norm4: Optional[Tensor] = None
        self.entry4: Optional[Tensor] = None

    def add(self, rows: Tensor) -> None:
        """Accumulate rows ``(n, fan_in)`` (float64)."""
        squares = rows.square()
        norm4, entry4 = squares.sum(1).square().sum(), squares.square().sum()
        if self.norm4 is None:
            self.norm4, self.entry4 = norm4, entry4
        else:
            self.norm4, self.entry4 = self.norm4 + norm4.to(self.norm4), self.entry4 + entry4.to(self.entry4)
        self.rows += rows.shape[0]


def shrinkage_intensity(gram: Tensor, moments: RowMoments) -> float:
    """Ledoit–Wolf ``α`` in ``[0, 1]`` for ``gram`` (``(fan_in, fan_in)``, the Gram of the rows
    ``moments`` counted); 0 when there is nothing off the diagonal to shrink."""
    if moments.rows == 0 or moments.norm4 is None:
        return 0.0
    n = float(moments.rows)
    gram = gram.double()
    diagonal = gram.diagonal()
    off_diagonal = float(gram.square().sum() - diagonal.square().sum()) / n**2  # Σ_{j≠k} S_jk²
    if off_diagonal <= 0:
        return 0.0
    variance = (float(moments.norm4 - moments.entry4) / n - off_diagonal) / n
    return min(max(variance / off_diagonal, 0.0), 1.0)


def shrink(matrix: Tensor, intensity: float) -> Tensor:
    """``(1 − α)·M + α·diag(M)`` for a square ``matrix`` (a new tensor; ``M`` is unchanged)."""
    shrunk = matrix * (1.0 - intensity)
    shrunk.diagonal().add_(matrix.diagonal(), alpha=intensity)
    return shrunk


def note_few_rows(record: LayerRecord, moments: RowMoments, intensity: float) -> None:
    """Say in ``record.reason`` (the report) when the layer saw fewer calibration rows than
    it has inputs, and how much its statistics were shrunk for it."""
    if 0 < moments.rows < record.fan_in:
        record.reason = (
            f"calibrated on {moments.rows} rows, fewer than its {record.fan_in} inputs: "
            f"correlations shrunk by {intensity:.2f} towards the diagonal"
        )
