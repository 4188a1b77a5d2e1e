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

clamped to ``[0, 1]``: ``α`` falls like ``fan_in/n`` as rows accumulate and is near 1 when
they are fewer than the inputs.

Tokens of one sequence are not independent rows, and the estimate above would then shrink far
too little (MiniLM's layers see ~1000 token rows from 54 sentences and it gives α ≈ 0.02).
Rows are therefore pooled in *clusters* (a linear layer's input ``(..., T, fan_in)``: one
cluster per sequence of ``T`` rows, :func:`~panther_lite.conversion.kinds.linear.cluster_size`;
otherwise one per row) and the variance is the
cluster-robust one,

    Σ_{j≠k} Var(S_jk) ≈ ( Σ_c ‖offdiag(G_c)‖² − (Σ_c n_c²)·Σ_{j≠k} S_jk² ) / n²,

with ``G_c`` a cluster's own Gram (exact for equal cluster sizes; single rows give the
formula above). ``‖G_c‖² = ‖X_c X_cᵀ‖²`` costs ``T²·fan_in`` per sequence, and the only
statistics kept beside the Gram are two scalars (:class:`RowMoments`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..records import LayerRecord

__all__ = ["RowMoments", "shrinkage_intensity", "shrink", "note_few_rows"]


class RowMoments:
    """What a Gram's shrinkage needs beside it: the rows ``n``, ``Σ_c n_c²`` over clusters and
    ``Σ_c ‖offdiag(G_c)‖²`` (a float64 tensor on the rows' device: accumulating never
    synchronises)."""

    def __init__(self) -> None:
        self.rows = 0
        self.cluster_rows_squared = 0
        self.cluster_off_diagonal: Optional[Tensor] = None

    def add(self, rows: Tensor, cluster_size: int = 1) -> None:
        """Accumulate rows ``(n, fan_in)`` (float64), each run of ``cluster_size`` consecutive
        rows one cluster (``n`` a multiple of it)."""
        clusters = rows.reshape(-1, cluster_size, rows.shape[-1])
        if cluster_size == 1:
            squares = rows.square()
            full, diagonal = squares.sum(1).square().sum(), squares.square().sum()
        else:  # ‖X_c X_cᵀ‖² = ‖G_c‖², and diag(G_c) = column sums of squares
            full = torch.bmm(clusters, clusters.transpose(1, 2)).square().sum()
            diagonal = clusters.square().sum(1).square().sum()
        off_diagonal = full - diagonal
        if self.cluster_off_diagonal is None:
            self.cluster_off_diagonal = off_diagonal
        else:
            self.cluster_off_diagonal = self.cluster_off_diagonal + off_diagonal.to(self.cluster_off_diagonal)
        self.rows += rows.shape[0]
        self.cluster_rows_squared += clusters.shape[0] * cluster_size**2


def shrinkage_intensity(gram: Tensor, moments: RowMoments) -> float:
    """Ledoit–Wolf ``α`` in ``[0, 1]`` for ``gram`` (``(fan_in, fan_in)``, the Gram of the rows
    ``moments`` counted); 0 when there is nothing off the diagonal to shrink."""
    if moments.rows == 0 or moments.cluster_off_diagonal is None:
        return 0.0
    n = float(moments.rows)
    gram = gram.double()
    off_diagonal = float(gram.square().sum() - gram.diagonal().square().sum()) / n**2  # Σ_{j≠k} S_jk²
    if off_diagonal <= 0:
        return 0.0
    variance = (float(moments.cluster_off_diagonal) - moments.cluster_rows_squared * off_diagonal) / n**2
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
        record.note(
            f"calibrated on {moments.rows} rows, fewer than its {record.fan_in} inputs: "
            f"correlations shrunk by {intensity:.2f} towards the diagonal"
        )
