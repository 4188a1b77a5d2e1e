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

The estimate's *shape* (how ``α`` falls with the rows and the data's noise) is sound, its scale
less so: on MiniLM's layers the shrunk fits trailed the unshrunk ones. ``shrinkage="auto"``
(the default of :class:`~panther_lite.conversion.ConvertConfig`) therefore checks it on
held-back rows (:func:`choose_strength`): the clusters are split in two alternating halves
(:class:`HeldBack` records one), each half's fit at the layer's rank is made with ``c·α`` of
its own rows for ``c`` in ``0`` and :data:`MULTIPLES` and measured on the other half. The
``c*`` with the smallest summed held-back output error is the layer's best on its own outputs,
and it overshoots what is best for the model: a layer's error moves through every later layer
(through the LayerNorms after each residual sum, which weight each token by the inverse of
its scale), so a strength that lowers the layer's plain output error can raise the model's.
On all-MiniLM-L6-v2 at R = 0.5, each layer's best strength measured on the evaluation
sentences themselves gave a lower embedding cosine than no shrinkage (0.7493 against 0.7496),
and at R = 0.3 the held-back choice cost 0.004 in domain (0.007 on validation text). The strength used for
all the rows is therefore :data:`AUTO_FRACTION` ``· c*·α`` (``¼``, the largest share of
``1, ½, ¼, 0`` that kept the uniform fits within 0.002 of SVD-LLM in and out of domain at R = 0.3
and 0.5 on validation text no benchmark evaluates on, ``benchmarks/validate_defaults.py``),
measured on the held-back rows too and replaced by 0 when it is worse than none there. So
the strength used is never worse than none on the held-back rows. The multiples form a
geometric grid from ``¼``: where ``α`` is large (MiniLM's last attention output, ``α ≈ 0.65``)
the gain on held-back rows flattens well below ``½·α``. The check costs ``2·(2 + len(MULTIPLES))`` eigendecompositions on the layer's
smaller side, many times its fit beyond a thousand or so (a 2048 × 5632 layer: minutes on two
cores), and one more Gram while calibrating; it is therefore made only for layers at most
:data:`AUTO_CHECK_MAX_SIDE` on their smaller side (:func:`checks_strength`): the wider ones
are not shrunk, and their report ``reason`` says so. A float fixes the strength for every
layer; ``0`` or None turns shrinkage off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Union

import torch
from torch import Tensor

from ...nn.low_rank_fit import decomposition_dtype, row_slices
from ..records import LayerRecord
from .tokens import UNALIGNED_NOTE

__all__ = [
    "RowMoments", "HeldBack", "Strength", "MULTIPLES", "shrinkage_intensity", "shrink", "choose_strength",
    "layer_strength", "note_calibration", "AUTO_CHECK_MAX_SIDE", "checks_strength", "any_checked",
]

MULTIPLES = (0.25, 0.5, 1.0, 2.0)
"""The multiples ``c`` of the Ledoit–Wolf ``α`` that ``shrinkage="auto"`` tries besides ``c = 0``
(a geometric grid: ``¼`` lets a layer of large ``α`` stop short of ``½·α``)."""

AUTO_FRACTION = 0.25
"""The share of the held-back choice ``c·α`` that ``shrinkage="auto"`` uses (each layer's best
strength on its own outputs overshoots the model's best, see the module docstring); chosen on
validation text by ``benchmarks/validate_defaults.py``."""

AUTO_CHECK_MAX_SIDE = 1024
"""The widest smaller side (``min(fan_out, fan_in)``) of a layer whose ``shrinkage="auto"``
strength is checked on held-back rows; wider layers are not shrunk."""

Setting = Union[str, float]
_DAMPING = 1e-4  # the ridge the fits add to a Gram, relative to its mean diagonal (low_rank_fit's default)


class RowMoments:
    """What a Gram's shrinkage needs beside it: the rows ``n``, ``Σ_c n_c²`` over clusters and
    ``Σ_c ‖offdiag(G_c)‖²`` (a float64 tensor on the rows' device: accumulating never
    synchronises)."""

    def __init__(self) -> None:
        self.rows = 0
        self.cluster_rows_squared = 0
        self.cluster_off_diagonal: Optional[Tensor] = None

    def add(self, rows: Tensor, cluster_size: int = 1, real: Optional[Tensor] = None) -> None:
        """Accumulate rows ``(n, fan_in)`` (float64), each run of ``cluster_size`` consecutive
        rows one cluster (``n`` a multiple of it); ``real``: the count of real rows per cluster
        (the others are zeroed padding; None: all are real)."""
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
        if real is None:
            self.rows += rows.shape[0]
            self.cluster_rows_squared += clusters.shape[0] * cluster_size**2
        else:
            self.rows += int(real.sum())
            self.cluster_rows_squared += int(real.square().sum())

    def __sub__(self, other: "RowMoments") -> "RowMoments":
        """The moments of the rows counted here but not in ``other`` (a subset of them)."""
        rest = RowMoments()
        rest.rows, rest.cluster_rows_squared = self.rows - other.rows, self.cluster_rows_squared - other.cluster_rows_squared
        if self.cluster_off_diagonal is not None:
            held = 0 if other.cluster_off_diagonal is None else other.cluster_off_diagonal.to(self.cluster_off_diagonal)
            rest.cluster_off_diagonal = self.cluster_off_diagonal - held
        return rest


@dataclass
class HeldBack:
    """The Gram and moments of every other cluster (the 2nd, 4th, ...) of a layer's rows: one
    half of :func:`choose_strength`'s split (the other half is the whole minus this one)."""

    gram: Tensor
    moments: RowMoments = field(default_factory=RowMoments)
    clusters: int = 0

    @classmethod
    def empty(cls, fan_in: int, device) -> "HeldBack":
        return cls(torch.zeros(fan_in, fan_in, dtype=torch.float64, device=device))

    def add(self, rows: Tensor, cluster_size: int = 1, real: Optional[Tensor] = None) -> None:
        """Accumulate the held half of rows ``(n, fan_in)`` (float64), clusters as in :meth:`RowMoments.add`."""
        clusters = rows.reshape(-1, cluster_size, rows.shape[-1])
        first = 1 - self.clusters % 2  # clusters are numbered across calls; the odd ones are held
        self.clusters += clusters.shape[0]
        held = clusters[first::2].reshape(-1, rows.shape[-1])
        if held.shape[0] == 0:
            return
        self.gram.add_((held.t() @ held).to(self.gram.device))
        self.moments.add(held, cluster_size, None if real is None else real[first::2])


def shrinkage_intensity(gram: Tensor, moments: RowMoments) -> float:
    """Ledoit–Wolf ``α`` in ``[0, 1]`` for ``gram`` (``(fan_in, fan_in)``, the Gram of the rows
    ``moments`` counted); 0 when there is nothing off the diagonal to shrink."""
    if moments.rows == 0 or moments.cluster_off_diagonal is None:
        return 0.0
    n = float(moments.rows)
    squares = sum(float(gram[rows].double().square().sum()) for rows in row_slices(*gram.shape))
    off_diagonal = (squares - float(gram.diagonal().double().square().sum())) / n**2  # Σ_{j≠k} S_jk²
    if off_diagonal <= 0:
        return 0.0
    variance = (float(moments.cluster_off_diagonal) - moments.cluster_rows_squared * off_diagonal) / n**2
    return min(max(variance / off_diagonal, 0.0), 1.0)


def shrink(matrix: Tensor, intensity: float) -> Tensor:
    """``(1 − α)·M + α·diag(M)`` for a square ``matrix`` (a new tensor; ``M`` is unchanged)."""
    shrunk = matrix * (1.0 - intensity)
    shrunk.diagonal().add_(matrix.diagonal(), alpha=intensity)
    return shrunk


@dataclass(frozen=True)
class Strength:
    """:func:`choose_strength`'s result: ``value``, the strength for all the rows (``multiple``
    times their Ledoit–Wolf ``α``; ``multiple`` is :data:`AUTO_FRACTION` of the best multiple
    on the held-back rows, or 0), and ``held_errors``, per multiple tried (the grid and the one
    used), the summed squared output error ``Σ‖X_held (W − Ŵ)ᵀ‖²`` of the two halves' fits on
    the other half."""

    value: float
    multiple: float
    held_errors: Dict[float, float]


class _Half:
    """One half of the split: the Gram the fit is made on (``train``, its Ledoit–Wolf ``base``
    strength from ``moments``) and the one it is measured on (``test``). Each fit is the exact
    one (its basis ``Q``: top left singular vectors of ``W·C``, ``C² = G_α + λI`` damped as the
    layers' fits are), found on the smaller side: where ``fan_out <= fan_in`` from
    ``W (G_α + λI) Wᵀ``, which ``G_α = (1 − α)G + α·diag(G)`` makes a blend of three
    ``(fan_out, fan_out)`` matrices computed once."""

    def __init__(self, weight: Tensor, train: Tensor, moments: RowMoments, test: Tensor) -> None:
        self.weight, self.train, self.test = weight, train, test.to(weight)
        self.base = shrinkage_intensity(train, moments)
        self.reference = float(((weight @ self.test) * weight).sum())  # ‖X_test Wᵀ‖²
        diagonal = train.diagonal().to(weight)
        self.ridge = _DAMPING * max(float(diagonal.mean()), torch.finfo(torch.float64).tiny)
        if weight.shape[0] <= weight.shape[1]:  # W G_α Wᵀ as a blend
            self.blend = ((weight @ train.to(weight)) @ weight.t(), (weight * diagonal) @ weight.t(), weight @ weight.t())
        else:
            self.blend = None
            self.normal = weight.t() @ weight  # WᵀW, for C WᵀW C

    def error(self, strength: float, rank: int) -> float:
        """``‖X_test (W − QQᵀW)ᵀ‖²`` for the rank-``rank`` fit whitened by the train Gram shrunk by ``strength``."""
        projected = self._projected(strength, min(rank, *self.weight.shape))
        return self.reference - float(((projected @ self.test) * projected).sum())

    def _projected(self, strength: float, rank: int) -> Tensor:
        """``QᵀW`` ``(rank, fan_in)`` for the exact fit's basis ``Q``: the top eigenvectors of
        ``W (G_α + λI) Wᵀ``, or (``fan_out > fan_in``) ``Q = W C V Σ⁻¹`` from the top
        eigenpairs ``(Σ², V)`` of ``C WᵀW C`` with ``C² = G_α + λI``."""
        if self.blend is not None:
            full, diagonal, normal = self.blend
            square = (1.0 - strength) * full + strength * diagonal + self.ridge * normal
            basis = torch.linalg.eigh(0.5 * (square + square.t()))[1].flip(1)[:, :rank]
            return basis.t() @ self.weight
        shrunk = shrink(self.train.to(self.weight), strength)
        shrunk.diagonal().add_(self.ridge)
        values, vectors = torch.linalg.eigh(shrunk)
        root = (vectors * values.clamp_min(0).sqrt()) @ vectors.t()
        square = root @ self.normal @ root
        values, vectors = torch.linalg.eigh(0.5 * (square + square.t()))
        values, vectors = values.flip(0)[:rank], vectors.flip(1)[:, :rank]
        basis = (self.weight @ (root @ vectors)) / values.clamp_min(torch.finfo(values.dtype).tiny).sqrt()
        return basis.t() @ self.weight


def choose_strength(
    weight: Tensor, rank: int, gram: Tensor, moments: RowMoments, held: HeldBack
) -> Strength:
    """The shrinkage strength chosen on held-back rows (see the module docstring) for the
    rank-``rank`` fit of ``weight`` ``(fan_out, fan_in)`` whitened by ``gram`` (of the rows
    ``moments`` counted, ``held`` the statistics of half of them); strength 0 when a half
    holds no row (nothing to check against). Costs ``2·(2 + len(MULTIPLES))`` eigendecompositions
    on the layer's smaller side (two more for the share used), besides products with the Grams."""
    rest = moments - held.moments
    if held.moments.rows == 0 or rest.rows == 0:
        return Strength(0.0, 0.0, {})
    w = weight.detach().to(decomposition_dtype(weight))
    halves = (_Half(w, gram - held.gram, rest, held.gram), _Half(w, held.gram, held.moments, gram - held.gram))
    errors: Dict[float, float] = {}

    def measure(multiple: float) -> None:
        errors[multiple] = sum(half.error(min(1.0, multiple * half.base), rank) for half in halves)

    for multiple in (0.0,) + MULTIPLES:
        if multiple and not any(half.base for half in halves):
            break
        measure(multiple)
    used = AUTO_FRACTION * min(errors, key=lambda multiple: (errors[multiple], multiple))
    if used not in errors:
        measure(used)
    if errors[used] > errors[0.0]:
        used = 0.0
    return Strength(min(1.0, used * shrinkage_intensity(gram, moments)), used, errors)


def checks_strength(fan_out: int, fan_in: int) -> bool:
    """Whether ``shrinkage="auto"`` checks (and may use) a strength for a ``fan_out × fan_in`` layer."""
    return min(fan_out, fan_in) <= AUTO_CHECK_MAX_SIDE


def any_checked(records: Iterable[LayerRecord]) -> bool:
    """Whether any weight matrix of ``records`` (layers sharing one input's statistics; a
    mixture-of-experts record's parts) has its ``shrinkage="auto"`` strength checked: only
    then are held-back statistics kept."""
    return any(checks_strength(part.fan_out, part.fan_in) for record in records for part in record.parts)


def layer_strength(
    setting: Setting, weight: Tensor, rank: int, gram: Tensor, moments: RowMoments, held: Optional[HeldBack]
) -> float:
    """The strength a fit whitened by ``gram`` uses: ``setting`` when it is a number (the
    config's ``shrinkage``; 0 is off), else (``"auto"``) :func:`choose_strength` on ``held``
    (0 without held-back statistics or for a layer :func:`checks_strength` leaves out)."""
    if setting != "auto":
        return float(setting)
    if held is None or not checks_strength(*weight.shape):
        return 0.0
    return choose_strength(weight, rank, gram, moments, held).value


def note_calibration(
    record: LayerRecord, rows: int, intensity: float, unaligned: bool = False, setting: Setting = 0.0
) -> None:
    """Add to ``record``'s reason (the report) when the layer saw fewer real calibration rows
    than it has inputs, and how much its statistics were shrunk for it, when ``setting`` (the
    config's ``shrinkage``) is ``"auto"`` and the layer too wide for its check, and when its
    inputs did not line up with the batches' attention mask (all rows, padding too, were used)."""
    if 0 < rows < record.fan_in:
        record.note(
            f"calibrated on {rows} rows, fewer than its {record.fan_in} inputs: correlations shrunk by "
            f"{intensity:.2f} towards the diagonal"
        )
    if setting == "auto" and rows > 0 and not checks_strength(record.fan_out, record.fan_in):
        record.note(
            f"shrinkage='auto' is checked only up to {AUTO_CHECK_MAX_SIDE} on a layer's smaller side "
            "(its cost): not shrunk; a float shrinkage= sets a strength"
        )
    if unaligned:
        record.note(UNALIGNED_NOTE)
