"""Global rank allocation: one parameter budget shared by many layers, spent where it buys the most.

Each layer ``l`` offers a menu of sizes: a sketch of rank ``2·L·k`` (``k`` a multiple of the
rank multiple, storing ``2·L·k·(fan_in + fan_out)`` + bias entries, U buffers included) for
every ``k`` that stores fewer entries than the dense layer, or the dense layer itself (error 0).
The predicted error of a rank-``r`` fit is the layer's relative squared *output* error,

    e_l(r) = w_l · Σ_{i>r} σ_i² / Σ_i σ_i²,

with ``σ`` the singular values of the whitened weight ``W·G^{1/2}`` (the activation-aware
spectrum; with no calibration data ``G = I``, the weight's own spectrum). The fits are exactly
these truncations, so ``e_l`` is what the fit will achieve on the calibration data. A layer's
relative perturbation reaches the model's output multiplied by a gain ``g_l``, and independent
perturbations add in squared norm, so the objective is ``Σ_l e_l`` with ``w_l = g_l²``,
minimised subject to ``Σ_l stored_l ≤ budget``. ``convert`` measures the gains on a calibration
batch (:mod:`.sensitivity`); without calibration data every ``w_l`` is 1 (relative errors alone,
right for a network whose layers are normalised).

Algorithm: this is a multiple-choice knapsack (one size per layer), solved exactly by dynamic
programming over the budget cut into at most 4096 units, each layer's costs rounded up to whole
units so the plan never exceeds the budget (exact when the budget is at most 4096 entries; the
rounding leaves at most one unit per layer unused). A final pass spends what is left on the
moves with the largest error decrease per stored entry that still fit, so the budget is filled
up to less than one rank step. A greedy walk along each layer's convex hull would be optimal
only for the continuous relaxation; on coarse menus (small layers) it can lose to a uniform
split, the dynamic program cannot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...nn.low_rank_fit import damped_metric_root, metric_times
from ...nn.rank_selection import dense_size, sketch_size

__all__ = [
    "LayerSpectrum", "Allocation", "BudgetTooSmall", "allocate_budget", "minimum_stored", "largest_sketch", "whitened_energy",
    "expert_energies",
]

_BUDGET_STEPS = 4096


class BudgetTooSmall(ValueError):
    """The budget is below what the layers store at their smallest sizes (``minimum``
    entries); ``minimum_ratio`` is that as a fraction of their dense size when known."""

    def __init__(self, message: str, minimum: int, minimum_ratio: float = float("nan")) -> None:
        super().__init__(message)
        self.minimum, self.minimum_ratio = minimum, minimum_ratio


def whitened_energy(
    weight: Tensor, gram: Optional[Tensor] = None, damping: float = 1e-4, output_gram: Optional[Tensor] = None
) -> Tensor:
    """Squared singular values of ``R·W·C`` (``C Cᵀ = G + λ·mean(diag G)·I``, as the fit
    damps it; ``R``: the damped root of an output metric, as the fit takes it), by decreasing
    size; ``gram=None`` means ``G = I`` (the weight's own spectrum), ``output_gram=None`` ``R = I``.

    Args:
        weight: ``(fan_out, fan_in)``.
        gram: optional ``(fan_in, fan_in)`` Gram ``XᵀX`` of the layer's inputs.
        output_gram: optional metric ``F`` on the outputs, ``(fan_out, fan_out)`` or its
            diagonal; ``R = (F + 0.01·mean(diag F)·I)^{1/2}`` at ``F``'s own scale
            (:func:`~panther_lite.nn.low_rank_fit.damped_metric_root`), so the energies are
            in ``F``'s units.

    Returns:
        ``(min(fan_out, fan_in),)`` float64: the eigenvalues of ``RW G WᵀR`` (or of
        ``Lᵀ WᵀR²W L`` with ``G = L Lᵀ`` when ``fan_in`` is the smaller side).

    Example:
        >>> energy = whitened_energy(torch.diag(torch.tensor([3.0, 1.0])), output_gram=torch.tensor([1.0, 0.0]))
        >>> [round(float(e), 3) for e in energy]
        [9.045, 0.005]
    """
    w = weight.detach().double()
    if output_gram is not None:
        w = metric_times(damped_metric_root(output_gram.detach().double().to(w.device), w.shape[0]), w)
    if gram is None:
        square = w @ w.t() if w.shape[0] <= w.shape[1] else w.t() @ w
    else:
        g = 0.5 * (gram.double() + gram.double().t())
        g = g + damping * g.diagonal().mean().clamp_min(torch.finfo(g.dtype).tiny) * torch.eye(
            g.shape[0], dtype=g.dtype, device=g.device
        )
        if w.shape[0] <= w.shape[1]:
            square = w @ g.to(w.device) @ w.t()
        else:
            factor = torch.linalg.cholesky(g).to(w.device)
            root = w @ factor
            square = root.t() @ root
    return torch.linalg.eigvalsh(0.5 * (square + square.t())).flip(0).clamp_min(0)


@dataclass(frozen=True)
class LayerSpectrum:
    """What the allocation needs to know about one layer.

    ``energy``: 1-D, the squared singular values ``σ_i²`` of the layer's whitened weight (any
    order, any length up to ``min(fan_in, fan_out)``); ``importance``: the weight ``w_l``;
    ``multiple``: ``low_rank`` is a multiple of it (tensor-core alignment), except where even
    ``low_rank = multiple`` would not beat dense (then steps of 1).

    A stack of ``copies`` matrices of one shape sized together (a mixture-of-experts
    projection: one per expert, sharing one rank) has ``energy`` ``(copies, n)``, one spectrum
    per matrix: its error at rank ``r`` is ``w_l·Σ_c Σ_{i>r} σ_ci² / Σ_c Σ_i σ_ci²`` and it stores
    ``copies`` times one matrix's entries.
    """

    fan_in: int
    fan_out: int
    bias: bool
    energy: Tensor
    importance: float = 1.0
    multiple: int = 1
    copies: int = 1


@dataclass(frozen=True)
class Allocation:
    """The size chosen for one layer: ``low_rank`` (None: kept dense), the ``stored`` entries
    (U buffers and bias included) and the predicted relative squared output ``error``."""

    low_rank: Optional[int]
    stored: int
    error: float


@dataclass(frozen=True)
class _Menu:
    """A layer's possible sizes, by increasing cost: ``ranks[i]`` (None for dense) stores
    ``costs[i]`` entries with predicted error ``errors[i]``."""

    ranks: List[Optional[int]]
    costs: List[int]
    errors: List[float]


def _menu(layer: LayerSpectrum, num_terms: int) -> _Menu:
    dense = layer.copies * dense_size(layer.fan_in, layer.fan_out, layer.bias)
    energy = layer.energy.detach().double()
    energy = energy.reshape(-1, energy.shape[-1]).clamp_min(0).sort(dim=-1, descending=True).values  # (copies, n)
    total = float(energy.sum())
    # remaining[r] = Σ_c Σ_{i>=r} σ_ci², so rank-r fits leave remaining[r].
    tails = torch.cat([energy.flip(-1).cumsum(-1).flip(-1), energy.new_zeros(energy.shape[0], 1)], dim=-1)
    remaining = tails.sum(0).tolist()

    def error(rank: int) -> float:
        if total <= 0:
            return 0.0
        return layer.importance * remaining[min(rank, len(remaining) - 1)] / total

    def fits(k: int) -> bool:
        return layer.copies * sketch_size(layer.fan_in, layer.fan_out, num_terms, k, layer.bias).stored < dense

    step = layer.multiple if fits(layer.multiple) else 1
    ranks: List[Optional[int]] = []
    k = step
    while fits(k):
        ranks.append(k)
        if 2 * num_terms * k >= len(remaining) - 1:
            break  # the fit is exact from here on: more rank only costs
        k += step
    costs = [layer.copies * sketch_size(layer.fan_in, layer.fan_out, num_terms, k, layer.bias).stored for k in ranks]
    errors = [error(2 * num_terms * k) for k in ranks]
    return _Menu(ranks + [None], costs + [dense], errors + [0.0])


def largest_sketch(layer: LayerSpectrum, num_terms: int) -> Optional[Allocation]:
    """The largest sketch of ``layer`` that stores fewer entries than dense (None: none does)."""
    menu = _menu(layer, num_terms)
    if len(menu.ranks) < 2:
        return None
    return Allocation(menu.ranks[-2], menu.costs[-2], menu.errors[-2])


def minimum_stored(layers: Sequence[LayerSpectrum], *, num_terms: int = 1) -> int:
    """The fewest entries the layers can store together (each at its cheapest size)."""
    return sum(_menu(layer, num_terms).costs[0] for layer in layers)


def _efficiency(menu: _Menu, frm: int, to: int) -> float:
    return (menu.errors[frm] - menu.errors[to]) / (menu.costs[to] - menu.costs[frm])


def _knapsack(menus: List[_Menu], budget: float) -> List[int]:
    """Menu index per layer minimising the summed error with summed cost <= ``budget``.

    Dynamic programming over the budget in ``_BUDGET_STEPS`` units of ``unit`` entries, each
    cost rounded *up* to whole units (so the choice never exceeds the budget; it is exact when
    ``unit`` is 1). ``best[b]``: least error of the layers so far within ``b`` units.
    """
    unit = max(1, math.ceil(budget / _BUDGET_STEPS))
    capacity = int(budget // unit)
    best = torch.zeros(capacity + 1, dtype=torch.float64)
    choices = []
    for menu in menus:
        new = torch.full_like(best, math.inf)
        choice = torch.full((capacity + 1,), -1, dtype=torch.long)
        for index, (cost, error) in enumerate(zip(menu.costs, menu.errors)):
            units = math.ceil(cost / unit)
            if units > capacity:
                break
            candidate = torch.full_like(best, math.inf)
            candidate[units:] = best[: capacity + 1 - units] + error
            better = candidate < new
            new = torch.where(better, candidate, new)
            choice = torch.where(better, torch.full_like(choice, index), choice)
        best = new
        choices.append(choice)
    chosen = []
    b = capacity
    for menu, choice in zip(reversed(menus), reversed(choices)):
        index = int(choice[b])
        chosen.append(index)
        b -= math.ceil(menu.costs[index] / unit)
    return chosen[::-1]


def _fill(menus: List[_Menu], chosen: List[int], left: float) -> None:
    """Spend what is left on the most efficient single moves that fit, one at a time."""
    while True:
        best: Optional[Tuple[float, int, int]] = None
        for layer, menu in enumerate(menus):
            here = chosen[layer]
            for to in range(here + 1, len(menu.costs)):
                if menu.costs[to] - menu.costs[here] > left:
                    break
                if menu.errors[to] < menu.errors[here]:
                    gain = _efficiency(menu, here, to)
                    if best is None or gain > best[0]:
                        best = (gain, layer, to)
        if best is None:
            return
        _, layer, to = best
        left -= menus[layer].costs[to] - menus[layer].costs[chosen[layer]]
        chosen[layer] = to


def allocate_budget(layers: Sequence[LayerSpectrum], budget: float, *, num_terms: int = 1) -> List[Allocation]:
    """Split ``budget`` stored entries among ``layers`` to minimise the summed predicted error.

    Args:
        layers: one :class:`LayerSpectrum` per layer.
        budget: entries the layers may store together (U buffers and biases included).
        num_terms: ``L`` of every sketch; a layer's rank moves in steps of ``2·L·multiple``.

    Returns:
        One :class:`Allocation` per layer, in order. The total stored never exceeds
        ``budget``; a layer is kept dense when that is the better use of the budget or when
        no sketch stores fewer entries than it.

    Raises:
        BudgetTooSmall: (a ValueError) ``budget`` is below :func:`minimum_stored` (every layer
            at its cheapest).
        ValueError: a layer's ``importance`` is NaN, infinite or negative.
    """
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    for index, layer in enumerate(layers):
        if not (math.isfinite(layer.importance) and layer.importance >= 0):
            raise ValueError(
                f"layers[{index}].importance must be a finite number >= 0, got {layer.importance!r}: "
                "a NaN/inf weight would make every error incomparable (everything would stay dense)"
            )
    menus = [_menu(layer, num_terms) for layer in layers]
    floor = sum(menu.costs[0] for menu in menus)
    if budget < floor:
        raise BudgetTooSmall(
            f"a budget of {budget:,.0f} stored entries is below the {floor:,} the layers need at their smallest "
            f"sizes (num_terms={num_terms}); raise param_ratio",
            floor,
        )
    chosen = _knapsack(menus, budget)
    _fill(menus, chosen, budget - sum(menu.costs[i] for menu, i in zip(menus, chosen)))
    return [Allocation(menu.ranks[i], menu.costs[i], menu.errors[i]) for menu, i in zip(menus, chosen)]


def expert_energies(record, recorder, setting="auto") -> Dict[str, Tensor]:
    """``{part name: (E, n) whitened spectra}`` of each projection of a mixture of experts from its
    :class:`~panther_lite.conversion.calibration.experts.ExpertsRecorder`, the Grams shrunk as
    ``setting`` (the config's ``shrinkage``) says; without statistics (or rows), each expert's
    weight spectrum. An expert fitted data-free counts with its weight's own spectrum scaled by
    its Gram's mean diagonal (its share of the calibration data's output energy, without the
    directions it cannot estimate)."""
    calibrated = recorder is not None and recorder.rows > 0
    grams = recorder.fit_grams(setting) if calibrated else {}
    energies = {}
    for part in record.parts:
        free = set(recorder.data_free(part)) if calibrated else set()
        rows = []
        for e in range(part.copies):
            weight = part.expert_matrix(e)
            if not calibrated:
                rows.append(whitened_energy(weight))
            elif e in free:
                scale = float(recorder.grams[part.projection][e].diagonal().mean())
                rows.append(scale * whitened_energy(weight))
            else:
                rows.append(whitened_energy(weight, grams[part.projection][e]))
        energies[part.name] = torch.stack(rows)
    return energies
