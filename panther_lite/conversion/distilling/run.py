"""One distillation run (:func:`~panther_lite.conversion.distilling.distillation.distill`): the batches
and their held-back split, the loss of one batch, and the Adam loop with its warm-up,
schedule and early stopping on the held-back loss.

Across processes (the process group active) a step is the one-process step: its batch runs on the
rank that holds it (batch ``i`` on rank ``i % world``), the others add zero gradients, so the
gradients summed over the ranks
(:func:`~panther_lite.conversion.process_groups.refinement.sum_gradients`) are that batch's and
every rank takes the one-process Adam step; the held-back and training losses are each batch's
own, added in batch order
(:func:`~panther_lite.conversion.process_groups.refinement.sum_in_call_order`)."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..calibration.batches import evaluation_run, run_batch
from ..calibration.random_tokens import random_token_batches
from ..fitting.autocast import autocast_run, loss_scaler
from ..fitting.master_weights import widened
from ..fitting.refinement import held_back_indices
from ..process_groups.distillation import Owned
from ..process_groups.refinement import sum_gradients, sum_in_call_order
from ..progress import progress_bar
from .config import DistillConfig
from .step_budget import StepBudget

__all__ = [
    "RandomTokens", "Run", "Session", "Targets", "data_batches", "device_of", "live_targets", "on_device", "optimise",
    "warmup_steps",
]

def data_batches(data) -> list:
    """``data``'s batches as a list (TypeError naming a bad one)."""
    if isinstance(data, Tensor):
        raise TypeError("distill: data must be an iterable of batches, got a single Tensor; pass e.g. x.split(32)")
    if callable(data) or isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"distill: data must be an iterable of batches (Tensor, tuple or dict), got {type(data).__name__}")
    batches = list(data)
    for index, batch in enumerate(batches):
        if not isinstance(batch, (Tensor, tuple, list, Mapping)):
            raise TypeError(
                f"distill: data batch {index} is {type(batch).__name__}; batches must be a Tensor (model(b)), "
                "a tuple/list (model(*b)) or a dict (model(**b))"
            )
    return batches


def device_of(model) -> torch.device:
    """The device of ``model``'s first parameter (the CPU without any)."""
    tensor = next(iter(model.parameters()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def on_device(batch: Mapping, device: torch.device) -> dict:
    """A dict batch's tensors on ``device``."""
    return {key: value.to(device) for key, value in batch.items()}


class RandomTokens:
    """``draw(p)``: ``count`` random-token sequences of ``length`` tokens (seed ``seed + p``)
    in batches of 32 on ``device``."""

    def __init__(self, tokenizer, count: int, length: int, seed: int, device: torch.device) -> None:
        self.tokenizer, self.count, self.length, self.seed, self.device = tokenizer, count, length, seed, device

    def draw(self, draw: int) -> list:
        if not self.count:
            return []
        batches = random_token_batches(self.tokenizer, self.count, self.length, seed=self.seed + draw)
        return [on_device(batch, self.device) for batch in batches]


Targets = Callable[[int, object], object]
"""``targets(index, batch)``: what the objective compares the student's output on batch
``index`` with (:func:`live_targets`, or a cache's :meth:`~.teacher_cache.TeacherOutputs.target`)."""


def live_targets(teacher, objective) -> Targets:
    """The teacher run on each batch (eval mode, no grad) for its compared output."""
    def target(index: int, batch):
        with evaluation_run(teacher):
            return objective.target(run_batch(teacher, batch, index))

    return target


class Session:
    """The student, the teacher's outputs (``targets``), the batches and how they are compared:
    ``data``'s batches and then the random-token ones; ``held`` / ``train``: the indices of the
    held-back and training batches, spread evenly over them all; ``widen``: the student is held
    in float32 (:func:`~panther_lite.conversion.fitting.master_weights.in_float32`), so its
    batches' half-precision tensors are widened (the teacher's are not); ``autocast``: the dtype
    the student runs in under ``torch.autocast`` (None: its own); ``owned(i)``: batch ``i``
    runs on this process (set by the caller; every batch in one process)."""

    def __init__(self, model, targets: Targets, data: list, random_tokens: RandomTokens, holdout: float,
                 objective) -> None:
        self.model, self.targets, self.objective, self.random_tokens = model, targets, objective, random_tokens
        self.device = device_of(model)
        self.widen = False
        self.autocast: Optional[torch.dtype] = None
        self.owned: Owned = lambda index: True
        self.first_random, self.batches = len(data), data + random_tokens.draw(0)
        if len(self.batches) < 2:
            raise ValueError(
                f"distill: data holds {len(self.batches)} batch(es); at least 2 are needed, as one is held back for "
                "early stopping (split the batch, e.g. x.split(32), or add random_tokens)"
            )
        self.held = held_back_indices(len(self.batches), holdout)
        self.train = [index for index in range(len(self.batches)) if index not in self.held]

    def loss(self, index: int) -> Tensor:
        """The loss of batch ``index``: the teacher's target first, then the student as it is."""
        batch = self.batches[index]
        target = self.targets(index, batch)
        with autocast_run(self.autocast, self.device):
            output = run_batch(self.model, widened(batch) if self.widen else batch, index)
        return self.objective(batch, output, target)

    def held_loss(self) -> float:
        """The mean loss over the held-back batches (inf when not finite), added in batch order;
        the student is expected in eval mode."""
        mine = [position for position, index in enumerate(self.held) if self.owned(index)]
        with torch.no_grad():
            losses = [(float(self.loss(self.held[position])),) for position in mine]
        (total,) = sum_in_call_order(losses, mine, len(self.held), 1, "the held-back losses")
        mean = total / len(self.held)
        return mean if math.isfinite(mean) else math.inf

    def passes(self, seed: int) -> Iterator[int]:
        """The training batches' indices over and over, reshuffled for each pass; from the
        second pass on, the training random-token batches are drawn afresh (the held-back
        ones stay), so the model never sees the same random sequence twice."""
        generator = torch.Generator().manual_seed(seed)
        for draw in itertools.count():
            if draw and self.random_tokens.count:
                fresh = self.random_tokens.draw(draw)
                for index in self.train:
                    if index >= self.first_random:
                        self.batches[index] = fresh[index - self.first_random]
            for position in torch.randperm(len(self.train), generator=generator).tolist():
                yield self.train[position]


def warmup_steps(max_steps: int) -> int:
    """The steps of the linear warm-up: the first 5% of ``max_steps``, at least one (Adam's
    first steps are about ``lr`` on every entry whatever the gradient)."""
    return max(1, max_steps // 20)


def _lr_factor(schedule: str, budget: StepBudget) -> Callable[[int], float]:
    """The learning rate of step ``i`` (0-based) over ``lr``: a linear warm-up over
    :func:`warmup_steps` of ``max_steps``, then constant or a cosine decay to 0 at the step the
    ``budget`` plans to stop at when the rate is asked for."""
    warmup = warmup_steps(budget.max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, budget.steps - warmup))))

    return factor


@dataclass
class Run:
    """The state of the loop: the best held-back loss so far, where it was found, and the
    training losses since the last evaluation. Evaluations within the first ``warmup`` steps
    do not count towards ``patience``: the rate has not reached its peak yet."""

    best_loss: float
    warmup: int = 0
    steps: int = 0
    best_step: int = 0
    stop_reason: str = "max_steps"
    since_best: int = 0
    history: List[Tuple[int, float, float]] = field(default_factory=list)
    train_losses: List[Optional[float]] = field(default_factory=list)  # None: the step's batch ran elsewhere

    def evaluated(self, held: float, parameters, best: List[Tensor], patience: int) -> bool:
        """Record an evaluation after ``self.steps`` steps, keep the parameters when they are
        the best so far; False when training must stop."""
        mine = [step for step, loss in enumerate(self.train_losses) if loss is not None]
        (total,) = sum_in_call_order([(self.train_losses[step],) for step in mine], mine, len(self.train_losses), 1,
                                     "the training losses")
        train_loss = total / len(self.train_losses)
        self.history.append((self.steps, train_loss, held))
        self.train_losses.clear()
        if held == math.inf:
            self.stop_reason = "non-finite loss"
            return False
        if held < self.best_loss:
            self.best_loss, self.best_step, self.since_best = held, self.steps, 0
            with torch.no_grad():
                for keep, parameter in zip(best, parameters):
                    keep.copy_(parameter)
            return True
        if self.steps <= self.warmup:
            return True
        self.since_best += 1
        if self.since_best >= patience:
            self.stop_reason = "patience"
            return False
        return True


def _step(session: Session, index: int, optimizer, scaler: torch.amp.GradScaler) -> Tuple[bool, Optional[float]]:
    """One Adam step on batch ``index``: whether it was taken (not when the loss is not finite, on
    the rank holding the batch) and the loss (None on a rank that does not hold the batch).
    ``scaler`` scales the loss of a float16 autocast (every rank scales, so every rank unscales
    the summed gradients alike; a step whose gradients overflow is skipped and the scale lowered)."""
    optimizer.zero_grad(set_to_none=True)
    loss = session.loss(index) if session.owned(index) else None
    failed = loss is not None and not bool(torch.isfinite(loss))
    backward = loss is not None and not failed
    scaled = scaler.scale(loss if backward else torch.zeros((), device=session.device))
    if backward:
        scaled.backward()
    if sum_gradients([p for group in optimizer.param_groups for p in group["params"]], failed):
        return False, None
    scaler.step(optimizer)
    scaler.update()
    return True, None if loss is None else float(loss.detach())


def _planned(budget: StepBudget, taken: int, bar) -> None:
    """Plan the steps that fit in the time limit after ``taken`` steps; the bar shows them."""
    budget.plan(taken)
    if budget.lowered and getattr(bar, "total", None) != budget.steps and hasattr(bar, "refresh"):
        bar.total = budget.steps
        bar.refresh()


def _evaluated(session: Session, run: Run, parameters, best: List[Tensor], settings: DistillConfig,
               budget: StepBudget, bar) -> bool:
    """Evaluate on the held-back batches after ``run.steps`` steps, keep the best parameters and plan
    the steps left; False when training stops (its reason in ``run.stop_reason``)."""
    held = session.held_loss()
    if hasattr(bar, "set_postfix"):
        bar.set_postfix(held_loss=f"{held:.4g}")
    if not run.evaluated(held, parameters, best, settings.patience):
        return False
    _planned(budget, run.steps, bar)
    if run.steps < budget.steps:
        return True
    run.stop_reason = "max_minutes" if budget.lowered else "max_steps"
    return False


def optimise(session: Session, parameters, best: List[Tensor], run: Run, settings: DistillConfig, progress) -> None:
    """Train until ``max_steps`` (or, with ``max_minutes``, the steps that fit in it: planned at the
    end of the warm-up and after every evaluation), ``patience`` evaluations without a better
    held-back loss, or a non-finite loss, keeping the best parameters in ``best``."""
    optimizer = torch.optim.Adam(parameters, lr=settings.lr)
    scaler = loss_scaler(session.autocast, session.device)
    budget = StepBudget(settings.max_steps, settings.max_minutes)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(settings.schedule, budget))
    order = session.passes(settings.seed)
    eval_every = settings.eval_every or len(session.train)
    bar = progress_bar(range(1, settings.max_steps + 1), "distilling", "step", progress)
    try:
        for step in bar:
            taken, loss = _step(session, next(order), optimizer, scaler)
            if not taken:
                run.stop_reason = "non-finite loss"
                return
            run.steps = step
            run.train_losses.append(loss)
            if step == run.warmup:
                _planned(budget, step, bar)
            evaluating = not step % eval_every or step >= budget.steps
            if evaluating and not _evaluated(session, run, parameters, best, settings, budget, bar):
                return
            schedule.step()
    finally:
        if hasattr(bar, "close"):
            bar.close()
