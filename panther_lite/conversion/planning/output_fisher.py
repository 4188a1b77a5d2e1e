"""The Fisher information of a model's next-token distributions at each layer's output: the
metric on a layer's output channels that its fit weighs its error by.

To second order the next-token KL a change ``δ`` of a layer's output costs is ``½ δᵀ F δ`` per
token, with ``F = E[Jᵀ (diag p − p pᵀ) J]`` (``J``: the logits' Jacobian at that output).
:meth:`~.output_distance.OutputProbe.direction` draws ``u = p − e_y`` with ``y ~ p``, whose
covariance is the softmax's Fisher, so ``g = Jᵀu`` (one backward pass for every layer at once) has
``E[g gᵀ] = F``. Summed over the real tokens of the calibration batches, ``F`` is the output-side
Kronecker factor of the KL's Hessian beside the input Gram ``G`` the fits already use
(:func:`~panther_lite.nn.low_rank_fit.sketch_factors_from_weight`'s ``output_gram``).

A layer wider than ``full_up_to`` outputs gets the diagonal of ``F`` alone (a 14,336-wide
projection's full ``F`` is 0.8 GB in float32).

A global plan reads the same metric: a layer holding ``F`` offers the spectrum of ``R W C``
(``R = F^{1/2}``, :func:`~.allocation.whitened_energy`), whose tail beyond a rank is the KL its
fit at that rank costs, in units shared by every layer measured on the same tokens; its
weight in the plan is its total energy (:func:`fisher_importances`), so the plan minimises the
summed predicted KL rather than relative errors times measured gains.
"""
from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Mapping, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from ..calibration.batches import CalibrationData, ModelRun, evaluation_run
from ..records import LayerRecord
from .sensitivity import probe_run

NO_LOGITS = ("output Fisher: the model's output holds no next-token logits (a language model's, or a classifier's "
             "logits) to weigh the fits by; convert without output_fisher")

FULL_UP_TO = 4096
"""Widest output with a full ``F`` (float64 accumulation: 4096² entries are 128 MB)."""


def tapped_outputs(layers: Mapping[str, nn.Module], taps: Dict[str, List[Tensor]]) -> list:
    """Forward hooks adding a zero leaf to each layer's output (kept in ``taps``): the gradient
    reaching that leaf is the one at the layer's output, while the graph runs on through it."""

    def tap(name: str):
        def hook(module: nn.Module, args: tuple, output):
            if not isinstance(output, Tensor) or not output.is_floating_point():
                raise ValueError(f"output Fisher: layer {name!r} returned {type(output).__name__}, expected a tensor")
            zero = torch.zeros_like(output, requires_grad=True)
            taps.setdefault(name, []).append(zero)
            return output + zero

        return hook

    return [module.register_forward_hook(tap(name)) for name, module in layers.items()]


def _output_gradients(model: nn.Module, layers: Mapping[str, nn.Module], run: ModelRun, generator) -> Dict[str, List[Tensor]]:
    """``{name: [g per call]}``: ``Jᵀu`` at each layer's output for one sampled direction ``u``."""
    taps: Dict[str, List[Tensor]] = {}
    handles = tapped_outputs(layers, taps)
    try:
        with evaluation_run(model), torch.enable_grad():
            probe = probe_run(model, run, "kl")
            if probe is None or not probe.kl:
                raise ValueError(NO_LOGITS)
            leaves = [leaf for name in taps for leaf in taps[name]]
            grads = torch.autograd.grad(probe.tensor, leaves, probe.direction(generator), allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return tap_gradients(taps, grads)


def tap_gradients(taps: Dict[str, List[Tensor]], grads: Sequence) -> Dict[str, List[Tensor]]:
    """``{name: [gradient per call]}`` from ``grads``, the gradients of the leaves of ``taps`` in
    their order (None, a leaf the output does not reach, as zeros)."""
    found, position = {}, 0
    for name, leaf_list in taps.items():
        found[name] = [g if g is not None else torch.zeros_like(leaf) for g, leaf in
                       zip(grads[position:position + len(leaf_list)], leaf_list)]
        position += len(leaf_list)
    return found


def add_fisher_terms(sums: Dict[str, Tensor], gradients: Mapping[str, List[Tensor]], full_up_to: int = FULL_UP_TO) -> None:
    """Add each layer's ``g gᵀ`` summed over the rows of its output gradients to ``sums``
    (float64; only its diagonal for a layer wider than ``full_up_to``)."""
    for name, grads in gradients.items():
        for grad in grads:
            rows = grad.detach().reshape(-1, grad.shape[-1]).double()
            term = (rows * rows).sum(0) if rows.shape[1] > full_up_to else rows.t() @ rows
            sums[name] = term if name not in sums else sums[name] + term


def output_fishers(
    model: nn.Module, layers: Mapping[str, nn.Module], runs: Iterable[ModelRun], *, full_up_to: int = FULL_UP_TO, seed: int = 0
) -> Dict[str, Tensor]:
    """``{name: F}``: the Fisher information of ``model``'s next-token distributions at the output
    of each of ``layers`` (``{name: module}``, modules of ``model``), summed over the tokens of ``runs`` (each ``run(model)`` one
    calibration batch), float64: ``(out, out)``, or ``(out,)`` (its diagonal) for layers wider than
    ``full_up_to``. Directions are drawn from a generator seeded with ``seed``; padded tokens count
    nothing (their direction is zero). The model is left as it was (parameters, training mode).

    Raises ValueError when the model's output holds no logits, or a layer returns no tensor.

    Example (``batches``: dicts of ``input_ids`` and ``attention_mask``)::

        fishers = output_fishers(model, {"q": model.model.layers[0].self_attn.q_proj},
                                 [lambda m, b=b: m(**b) for b in batches])
    """
    generator = torch.Generator().manual_seed(seed)
    sums: Dict[str, Tensor] = {}
    for run in runs:
        add_fisher_terms(sums, _output_gradients(model, layers, run, generator), full_up_to)
    return sums


def check_output_fisher(data: CalibrationData) -> None:
    """ValueError unless ``output_fisher=True`` has what it runs on: calibration data."""
    if not data.given:
        raise ValueError("output_fisher=True measures the Fisher on the calibration batches: pass calibration_data")


def fisher_targets(records: Sequence[LayerRecord]) -> List[LayerRecord]:
    """The records to convert whose fits take an output Fisher: one weight matrix, outputs
    feature-last (:attr:`~panther_lite.conversion.kinds.LayerKind.output_features_last`)."""
    return [r for r in records if r.to_convert and getattr(r.kind, "output_features_last", False)
            and getattr(r.kind, "strategy", "matrix") == "matrix"]


def attach_fishers(records: Sequence[LayerRecord], fishers: Mapping[str, Tensor]) -> None:
    """Each record's ``output_gram`` set to its Fisher in ``fishers`` (float32); a record with
    none or a zero one (the model's output does not depend on the layer) is noted and keeps None."""
    for record in records:
        fisher = fishers.get(record.name)
        if fisher is None or not bool((fisher.diagonal() if fisher.dim() == 2 else fisher).sum() > 0):
            record.note("output_fisher: no next-token Fisher reached this layer's output; fitted without it")
            continue
        record.output_gram = fisher.float()


def attach_output_fishers(model: nn.Module, records: Sequence[LayerRecord], data: CalibrationData, seed=None) -> None:
    """The next-token Fisher of every :func:`fisher_targets` record of ``model``, measured on
    each batch of ``data`` (:func:`output_fishers`, directions seeded with ``seed``, None: 0),
    set as its ``output_gram``."""
    targets = fisher_targets(records)
    if targets:
        fishers = output_fishers(model, {r.name: r.module for r in targets}, data.runs(), seed=seed or 0)
        attach_fishers(targets, fishers)


def release_fishers(records: Sequence[LayerRecord]) -> None:
    """Every record's ``output_gram`` dropped (its fit is done: the memory is freed)."""
    for record in records:
        record.output_gram = None


def fisher_totals(records: Sequence[LayerRecord], energies: Mapping[str, Tensor]) -> Dict[str, float]:
    """``{name: Σ energies[name]}`` of the ``records`` holding an output Fisher now (their
    energies Fisher-weighted: the whole output's KL cost in the Fisher's units)."""
    return {r.name: float(energies[r.name].sum()) for r in records if r.output_gram is not None and r.name in energies}


def fisher_importances(names: Sequence[str], gains: Mapping[str, float], totals: Mapping[str, float]) -> Dict[str, float]:
    """The global plan's weights (``{name: w}``, see :mod:`.allocation`) for the layers ``names``
    when those in ``totals`` have Fisher-weighted energies: each of those weighs its total, so
    its relative error times the weight is its predicted KL; every other layer keeps its
    measured squared gain (1 when none), scaled into the same units by the median of total /
    gain over the Fisher-weighted layers. Without ``totals``, ``gains`` as they are.

    Example:
        >>> fisher_importances(["a", "b", "c"], {"a": 2.0, "b": 4.0, "c": 1.0}, {"a": 6.0, "b": 8.0})
        {'a': 6.0, 'b': 8.0, 'c': 2.5}
    """
    if not totals:
        return dict(gains)
    ratios = [totals[n] / gains.get(n, 1.0) for n in totals if 0 < gains.get(n, 1.0) < float("inf")]
    scale = statistics.median(ratios) if ratios else 1.0
    return {name: totals[name] if name in totals else gains.get(name, 1.0) * scale for name in names}
