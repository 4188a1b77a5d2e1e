"""Block-wise refinement: a few Adam steps on a converted block's trainable factors so it
reproduces the *original* block's outputs on cached calibration calls (the per-block
reconstruction objective of post-training quantization: BRECQ, OmniQuant).

The closed-form fits are optimal layer by layer; refinement corrects what they cannot see,
the interaction of the layers inside a block (attention, nonlinearities). Small calibration
sets overfit it readily, so it stops early on held-back calls (or, with a single call,
held-back rows of it) and keeps the parameters that were best there: when nothing beats the
closed-form fit, the block is left exactly as it was.

Memory: the block's parameters twice (the best copy) and Adam's two moments, plus one call's
activations at a time (gradients are accumulated call by call).

Across processes (inside a conversion across them) each rank holds the calls of its own
batches: the split into training and held-back calls is the one-process split of all the calls,
the held-back errors and the loss's scale are the one-process sums of every call's terms, and
each step's gradients are summed over the ranks (:mod:`~panther_lite.conversion.process_groups.refinement`),
so every rank takes the same steps, stops at the same step and keeps the same parameters.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.validation import check_positive_int
from ..config import check_holdout, check_lr
from ..process_groups.refinement import call_positions, sum_gradients, sum_in_call_order
from ..progress import progress_bar

__all__ = ["RefinementResult", "best_kept", "held_back_indices", "refine_block"]


@dataclass(frozen=True)
class RefinementResult:
    """``error_before`` / ``error_after``: relative error ``‖pred − target‖_F / ‖target‖_F``
    on the held-back calls (or rows) before refinement and with the parameters kept;
    ``steps``: Adam steps taken; ``stopped_early``: stopped by ``patience`` (or a non-finite
    loss) before ``max_steps``."""

    error_before: float
    error_after: float
    steps: int
    stopped_early: bool


class _Split:
    """Which calls (or, with one call, which rows of it) train and which are held back.

    With ``n >= 2`` calls, ``h = max(1, ⌊holdout·n + ½⌋)`` calls (at most ``n − 1``) spread
    evenly over them are held back (calls ``⌈(i+1)·n/h⌉ − 1``: with batches sorted by length the
    held set spans the lengths); with one call its last rows (``output.reshape(-1, last_dim)``).
    Across processes ``n`` counts every rank's calls and ``positions`` places this rank's among
    them, so the split is the one-process split whatever the number of processes.
    """

    def __init__(self, total: int, positions: List[int], holdout: float, rows: int) -> None:
        self.by_rows, self.positions, self.total = total == 1, positions, total
        if self.by_rows:
            if rows < 2:
                raise ValueError(
                    "refine_block: a single cached call with fewer than 2 output rows leaves nothing to hold back; "
                    "cache more calibration calls"
                )
            held = min(rows - 1, max(1, int(holdout * rows + 0.5)))
            self.train_calls, self.held_calls, self.first_held_row = [0], [0], rows - held
        else:
            held_back = set(held_back_indices(total, holdout))
            self.held_calls = [i for i, position in enumerate(positions) if position in held_back]
            self.train_calls = [i for i, position in enumerate(positions) if position not in held_back]
            self.first_held_row = 0

    def rows(self, tensor: Tensor, held: bool) -> Tensor:
        """The part of a call's output (or target) that belongs to the training or held set."""
        if not self.by_rows:
            return tensor
        rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(-1, 1)
        return rows[self.first_held_row :] if held else rows[: self.first_held_row]

    def summed(self, values: Dict[int, Tuple[float, ...]], width: int, what: str) -> Tuple[float, ...]:
        """Per-call values (by this rank's call index) summed over every call in call order."""
        positions = [self.positions[index] for index in values]
        return sum_in_call_order(list(values.values()), positions, self.total, width, what)


def held_back_indices(calls: int, holdout: float) -> List[int]:
    """The ``h = max(1, ⌊holdout·calls + ½⌋)`` (at most ``calls − 1``) indices of ``calls >= 2``
    held back, spread evenly over them: ``⌈(i+1)·calls/h⌉ − 1``."""
    held = min(calls - 1, max(1, int(holdout * calls + 0.5)))
    return [-(-(i + 1) * calls // held) - 1 for i in range(held)]


@contextlib.contextmanager
def best_kept(parameters: Sequence[nn.Parameter]) -> Iterator[List[Tensor]]:
    """``parameters`` made trainable (``requires_grad``, no ``.grad``); yields copies of them
    for the caller to keep the best values in. On exit, also on error or KeyboardInterrupt,
    the parameters get those values and their ``requires_grad`` and ``.grad`` back."""
    saved = [(p.requires_grad, p.grad) for p in parameters]
    best = [p.detach().clone() for p in parameters]
    try:
        for parameter in parameters:
            parameter.requires_grad_(True)
            parameter.grad = None
        yield best
    finally:
        with torch.no_grad():
            for keep, parameter in zip(best, parameters):
                parameter.copy_(keep)
        for parameter, (requires_grad, grad) in zip(parameters, saved):
            parameter.requires_grad_(requires_grad)
            parameter.grad = grad


def _check_arguments(parameters, predict, targets, lr, holdout) -> List[nn.Parameter]:
    """The parameters as a list; TypeError / ValueError naming the bad argument."""
    parameters = list(parameters)
    if not parameters:
        raise ValueError("refine_block: parameters is empty; pass the trainable factors (S1/S2) of the block's layers")
    for index, parameter in enumerate(parameters):
        if not isinstance(parameter, Tensor) or not parameter.is_floating_point():
            kind = type(parameter).__name__
            raise TypeError(f"refine_block: parameters[{index}] must be a floating-point nn.Parameter, got {kind}")
        if not parameter.is_leaf:
            raise ValueError(f"refine_block: parameters[{index}] is not a leaf tensor; pass the block's nn.Parameters")
    if not callable(predict):
        raise TypeError(f"refine_block: predict must be a callable predict(i) -> Tensor, got {type(predict).__name__}")
    if len(targets) == 0:
        raise ValueError("refine_block: targets is empty; pass the original block's output for each cached call")
    for index, target in enumerate(targets):
        if not isinstance(target, Tensor):
            raise TypeError(f"refine_block: targets[{index}] must be a Tensor, got {type(target).__name__}")
    check_lr(lr)
    check_holdout(holdout)
    return parameters


def _prediction(predict: Callable[[int], Tensor], index: int, target: Tensor) -> Tensor:
    output = predict(index)
    if not isinstance(output, Tensor) or output.shape != target.shape:
        shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ValueError(
            f"refine_block: predict({index}) returned {shape}, but targets[{index}] has shape {tuple(target.shape)}"
        )
    return output


def _held_error(predict, targets: Sequence[Tensor], split: _Split) -> float:
    """Relative error on the held-back part, ``sqrt(Σ‖p − t‖² / Σ‖t‖²)`` (inf if not finite)."""
    parts = {}
    with torch.no_grad():
        for index in split.held_calls:
            target = split.rows(targets[index], held=True).double()
            output = split.rows(_prediction(predict, index, targets[index]), held=True).double()
            parts[index] = (float((output - target.to(output.device)).square().sum()), float(target.square().sum()))
    squared, reference = split.summed(parts, 2, "the held-back errors")
    error = math.sqrt(squared / reference) if reference > 0 else math.sqrt(squared)
    return error if math.isfinite(error) else math.inf


def _training_scale(targets: Sequence[Tensor], split: _Split) -> float:
    """``Σ‖target‖²`` over the training part (1 when zero): the loss is relative to it."""
    parts = {i: (float(split.rows(targets[i], held=False).double().square().sum()),) for i in split.train_calls}
    (scale,) = split.summed(parts, 1, "the training targets' norms")
    return scale if scale > 0 else 1.0


def _training_step(predict, targets: Sequence[Tensor], split: _Split, optimizer, scale: float) -> bool:
    """One Adam step on the relative squared error of the training part, gradients accumulated
    call by call (across processes: this rank's calls, then summed over the ranks); False (and no
    step) when the loss is not finite (on some rank)."""
    optimizer.zero_grad(set_to_none=True)
    failed = False
    with torch.enable_grad():
        for index in split.train_calls:
            target = split.rows(targets[index], held=False)
            output = split.rows(_prediction(predict, index, targets[index]), held=False)
            loss = (output - target.to(output)).float().square().sum() / scale
            if not torch.isfinite(loss):
                failed = True
                break
            loss.backward()
    if sum_gradients([p for group in optimizer.param_groups for p in group["params"]], failed):
        return False
    optimizer.step()
    return True


def refine_block(
    parameters: Sequence[nn.Parameter],
    predict: Callable[[int], Tensor],
    targets: Sequence[Tensor],
    *,
    max_steps: int = 100,
    lr: float = 1e-3,
    holdout: float = 0.25,
    patience: int = 10,
    progress: Optional[bool] = None,
) -> RefinementResult:
    """Adam on ``parameters`` so that ``predict(i)`` reproduces ``targets[i]``, with early
    stopping on held-back calls; the parameters best on those are kept.

    Args:
        parameters: the block's trainable factors (S1/S2 of its sketched layers, biases if
            wanted); their ``requires_grad`` flags and ``.grad`` are restored afterwards.
        predict: ``predict(i)`` runs the converted block on cached call ``i`` and returns its
            output, shaped like ``targets[i]``; it must build an autograd graph to ``parameters``
            (do not wrap it in ``no_grad``).
        targets: the original block's output for each cached call.
        max_steps: most Adam steps (each one pass over the training calls).
        lr: Adam's learning rate.
        holdout: fraction of the calls held back, spread evenly over them (at least one, at
            most all but one); with a single call, fraction of its rows
            (``output.reshape(-1, last_dim)``, the last ones).
        patience: stop after this many steps without a new best held-back error.
        progress: a tqdm bar over the steps (None: on a terminal only).

    Returns:
        :class:`RefinementResult`. ``error_after <= error_before`` always: when no step
        improves the held-back error, every parameter is restored bit for bit.

    Raises:
        TypeError / ValueError naming the argument; ValueError when ``predict(i)`` does not
        return a tensor shaped like ``targets[i]`` (nothing is changed then). Across processes
        (the conversion's process group active): ValueError on every rank when the ranks refine
        different parameters or hold other calls than sharding by rank gives them (call ``i`` on
        process ``i % world``).
    """
    parameters = _check_arguments(parameters, predict, targets, lr, holdout)
    max_steps, patience = check_positive_int("max_steps", max_steps), check_positive_int("patience", patience)
    first_target = targets[0]
    rows = first_target.reshape(-1, first_target.shape[-1]).shape[0] if first_target.dim() > 0 else 1
    split = _Split(*call_positions(len(targets), parameters), float(holdout), rows)
    with best_kept(parameters) as best:  # also on error: the block keeps its best (or original) parameters
        error_before = best_error = _held_error(predict, targets, split)
        optimizer, scale = torch.optim.Adam(parameters, lr=float(lr)), _training_scale(targets, split)
        steps, since_best, stopped_early = 0, 0, False
        for _ in progress_bar(range(max_steps), "refining", "step", progress):
            if not _training_step(predict, targets, split, optimizer, scale):
                stopped_early = True
                break
            steps += 1
            error = _held_error(predict, targets, split)
            if error < best_error:
                best_error, since_best = error, 0
                for keep, parameter in zip(best, parameters):
                    keep.copy_(parameter.detach())
            else:
                since_best += 1
                if since_best >= patience:
                    stopped_early = steps < max_steps
                    break
    return RefinementResult(error_before, best_error, steps, stopped_early)
