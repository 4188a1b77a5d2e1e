"""``panther_lite.distill``: end-to-end distillation of a converted model against the original.

The closed-form fits of :func:`~panther_lite.conversion.convert` are optimal layer by layer,
and block-wise refinement block by block; what they leave is the error the whole network
compounds. ``distill`` trains the converted model's sketched factors (optionally their biases
and the model's norms) with Adam so that its outputs match the original model's (the
teacher's) on calibration batches (and, with ``random_tokens``, batches of random tokens),
stopping when the loss on held-back batches stops improving and keeping the parameters best
there (Hinton et al. 2015; the last step of SVD-LLM-style compression pipelines).

Memory: the teacher and the student both, a float32 copy of each trained half-precision
parameter (:mod:`.master_weights`), a copy of the trained parameters (the best so far),
Adam's two float32 moments of them, and one batch's activations of both models (the
student's kept for the backward). Time: each step is one teacher forward and one student
forward and backward on one batch; each evaluation is both forwards on every held-back batch.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..nn.layer_base import SketchedLayer
from ..nn.validation import check_int, check_positive_int
from .block_refinement import only_these_train
from .calibration import evaluation_run, run_batch
from .distillation_objective import Objective, check_loss, check_outputs, check_temperature
from .master_weights import MasterWeights
from .progress import progress_bar
from .random_tokens import random_token_batches
from .refinement import best_kept, check_holdout, check_lr, held_back_indices

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["DistillationResult", "TRAINABLE", "distill", "trained_parameters"]

TRAINABLE = ("factors", "biases", "norms")


@dataclass(frozen=True)
class DistillationResult:
    """What :func:`distill` did.

    ``loss_before`` / ``loss_after``: the mean loss over the held-back batches before training
    and with the parameters kept (``loss_after <= loss_before``: when no evaluation beats the
    start, every parameter is restored bit for bit); ``steps``: optimizer steps taken (one
    batch each); ``best_step``: the step whose parameters were kept (0: the original ones);
    ``stop_reason``: ``"max_steps"``, ``"patience"`` or ``"non-finite loss"``;
    ``stopped_early``: stopped before ``max_steps``; ``loss``: the loss used (``"mse"``,
    ``"kl"``, ``"callable"``); ``train_batches`` / ``held_batches``: how the batches were
    split; ``trained_elements``: parameter elements trained; ``seconds``: wall time;
    ``history``: ``(step, held-back loss)`` at each evaluation, step 0 first.
    """

    loss_before: float
    loss_after: float
    steps: int
    best_step: int
    stopped_early: bool
    stop_reason: str
    loss: str
    train_batches: int
    held_batches: int
    trained_elements: int
    seconds: float
    history: Tuple[Tuple[int, float], ...] = field(default=(), repr=False)

    def history_frame(self) -> "pd.DataFrame":
        """``history`` as a DataFrame with columns ``step`` and ``held_loss``."""
        import pandas as pd

        return pd.DataFrame(list(self.history), columns=["step", "held_loss"])


@dataclass(frozen=True)
class _Settings:
    max_steps: int
    lr: float
    patience: int
    eval_every: Optional[int]
    seed: int


def _check_train(train) -> Tuple[str, ...]:
    names = (train,) if isinstance(train, str) else train
    if not isinstance(names, Iterable):
        raise TypeError(f"distill: train must be a str or a sequence of some of {TRAINABLE}, got {train!r}")
    names = tuple(names)
    if not names or any(not isinstance(name, str) or name not in TRAINABLE for name in names):
        raise ValueError(f"distill: train must name one or more of {TRAINABLE}, got {train!r}")
    return tuple(dict.fromkeys(names))


def _check_models(model, teacher) -> None:
    for name, module in (("model", model), ("teacher", teacher)):
        if not isinstance(module, nn.Module):
            raise TypeError(f"distill: {name} must be an nn.Module, got {type(module).__name__}")
    if model is teacher:
        raise ValueError(
            "distill: model and teacher are the same module; pass the converted model and the original "
            "(keep a copy.deepcopy of it from before convert)"
        )
    if not any(isinstance(module, SketchedLayer) for module in model.modules()):
        raise ValueError("distill: model has no sketched layer; convert it first (panther_lite.convert)")


def trained_parameters(model: nn.Module, train: Sequence[str]) -> List[nn.Parameter]:
    """The parameters ``train`` selects, each once, in module order: ``"factors"``, the
    sketched layers' trainable factors (``S1``/``S2``, a convolution's ``S``); ``"biases"``,
    their biases; ``"norms"``, the parameters of modules whose class name contains ``Norm``
    (``LayerNorm``, ``RMSNorm``, ``BatchNorm2d``, ``LlamaRMSNorm``, ...)."""
    chosen = {}
    for module in model.modules():
        if isinstance(module, SketchedLayer):
            for name, parameter in module.named_parameters(recurse=False):
                if ("biases" if name == "bias" else "factors") in train:
                    chosen[id(parameter)] = parameter
        elif "norms" in train and "Norm" in type(module).__name__:
            chosen.update((id(p), p) for p in module.parameters(recurse=False))
    return list(chosen.values())


def _checked_parameters(model: nn.Module, teacher: nn.Module, train: Tuple[str, ...]) -> List[nn.Parameter]:
    parameters = trained_parameters(model, train)
    if not parameters:
        raise ValueError(f"distill: train={train} selects no parameter of model")
    teachers = {id(parameter) for parameter in teacher.parameters()}
    if any(id(parameter) in teachers for parameter in parameters):
        raise ValueError(
            "distill: model shares parameters it would train with teacher, so training would change the teacher; "
            "convert a copy.deepcopy of the original"
        )
    return parameters


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def _batches(data, model: nn.Module, tokenizer, random_tokens) -> list:
    """``data``'s batches as a list, then the random-token batches on the model's device."""
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
    random_tokens = check_int("random_tokens", random_tokens, minimum=0)
    if random_tokens and tokenizer is None:
        raise ValueError(f"distill: random_tokens={random_tokens} needs tokenizer= (the model's tokenizer)")
    if random_tokens:
        device = _device_of(model)
        extra = random_token_batches(tokenizer, random_tokens)
        batches += [{key: value.to(device) for key, value in batch.items()} for batch in extra]
    if len(batches) < 2:
        raise ValueError(
            f"distill: data holds {len(batches)} batch(es); at least 2 are needed, as one is held back for early "
            "stopping (split the batch, e.g. x.split(32), or add random_tokens)"
        )
    return batches


class _Session:
    """The student, the teacher, the batches and how they are compared; ``held`` /
    ``train``: the indices of the held-back and training batches."""

    def __init__(self, model, teacher, batches: list, holdout: float, objective: Objective) -> None:
        self.model, self.teacher, self.batches, self.objective = model, teacher, batches, objective
        self.held = held_back_indices(len(batches), holdout)
        self.train = [index for index in range(len(batches)) if index not in self.held]

    def loss(self, index: int) -> Tensor:
        """The loss of batch ``index``: the teacher in eval mode without grad, the student as it is."""
        batch = self.batches[index]
        with evaluation_run(self.teacher):
            target = run_batch(self.teacher, batch, index)
        return self.objective(batch, run_batch(self.model, batch, index), target)

    def held_loss(self) -> float:
        """The mean loss over the held-back batches (inf when not finite); the student is
        expected in eval mode."""
        with torch.no_grad():
            total = sum(float(self.loss(index)) for index in self.held)
        mean = total / len(self.held)
        return mean if math.isfinite(mean) else math.inf


def _epochs(indices: List[int], seed: int) -> Iterator[int]:
    """``indices`` over and over, reshuffled for each pass."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for position in torch.randperm(len(indices), generator=generator).tolist():
            yield indices[position]


@dataclass
class _Run:
    """The state of the loop: the best held-back loss so far and where it was found."""

    best_loss: float
    steps: int = 0
    best_step: int = 0
    stop_reason: str = "max_steps"
    history: List[Tuple[int, float]] = field(default_factory=list)


def _step(session: _Session, index: int, masters: MasterWeights, optimizer, scaler) -> bool:
    """One Adam step on batch ``index`` (on the float32 masters, rounded back); False (and
    no step) when the loss is not finite."""
    loss = session.loss(index)
    if not torch.isfinite(loss):
        return False
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    masters.take_gradients()
    scaler.step(optimizer)
    scaler.update()
    masters.write_back()
    return True


def _optimise(session: _Session, parameters, best: List[Tensor], run: _Run, settings: _Settings, progress) -> None:
    """Train until ``max_steps``, ``patience`` evaluations without a better held-back loss,
    or a non-finite loss, keeping the best parameters in ``best``."""
    masters = MasterWeights(parameters)
    optimizer = torch.optim.Adam(masters.tensors, lr=settings.lr)
    scaler = torch.amp.GradScaler(parameters[0].device.type, enabled=masters.float16)
    order, since_best = _epochs(session.train, settings.seed), 0
    eval_every = settings.eval_every or len(session.train)
    bar = progress_bar(range(1, settings.max_steps + 1), "distilling", "step", progress)
    try:
        for step in bar:
            if not _step(session, next(order), masters, optimizer, scaler):
                run.stop_reason = "non-finite loss"
                return
            run.steps = step
            if step % eval_every and step < settings.max_steps:
                continue
            held = session.held_loss()
            run.history.append((step, held))
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(held_loss=f"{held:.4g}")
            if held == math.inf:
                run.stop_reason = "non-finite loss"
                return
            if held < run.best_loss:
                run.best_loss, run.best_step, since_best = held, step, 0
                with torch.no_grad():
                    for keep, parameter in zip(best, parameters):
                        keep.copy_(parameter)
            else:
                since_best += 1
                if since_best >= settings.patience:
                    run.stop_reason = "patience"
                    return
    finally:
        if hasattr(bar, "close"):
            bar.close()


def _settings(max_steps, lr, patience, eval_every, seed) -> _Settings:
    return _Settings(
        max_steps=check_positive_int("max_steps", max_steps),
        lr=check_lr(lr, "distill: "),
        patience=check_positive_int("patience", patience),
        eval_every=None if eval_every is None else check_positive_int("eval_every", eval_every),
        seed=check_int("seed", seed, minimum=0),
    )


def distill(
    model: nn.Module,
    teacher: nn.Module,
    data,
    *,
    train: Sequence[str] = ("factors", "biases"),
    outputs=None,
    loss="auto",
    temperature: float = 1.0,
    tokenizer=None,
    random_tokens: int = 0,
    max_steps: int = 500,
    lr: float = 1e-4,
    holdout: float = 0.25,
    patience: int = 5,
    eval_every: Optional[int] = None,
    seed: int = 0,
    progress: Optional[bool] = None,
) -> DistillationResult:
    """Train ``model`` (converted, in place) to reproduce ``teacher``'s outputs (the original
    model, never modified); early stopping on held-back batches keeps the best parameters.

    Args:
        model: the converted model (the student); holds at least one sketched layer.
        teacher: the original model (run in eval mode under ``no_grad``; its parameters,
            buffers, modes and flags are left as they were).
        data: an iterable of batches as ``convert``'s ``calibration_data`` takes them
            (Tensor → ``model(b)``, tuple → ``model(*b)``, dict → ``model(**b)``); each runs
            through both models. A share ``holdout`` of them (with the random-token batches),
            spread evenly, is held back for early stopping; at least two batches in all.
        train: what trains, one or more of ``"factors"`` (the sketched layers' ``S1``/``S2``,
            a convolution's ``S``), ``"biases"`` (their biases) and ``"norms"`` (parameters of
            modules whose class name contains ``Norm``). Everything else stays frozen.
        outputs: the output compared: None (a Tensor output, else ``logits``, else
            ``last_hidden_state``, else a tuple's first tensor), a key or attribute name, a
            tuple position, or a callable ``outputs(model_output) -> Tensor``.
        loss: ``"auto"`` (``"kl"`` for logits, ``"mse"`` otherwise), ``"kl"``
            (``T²·KL(softmax(t/T) ‖ softmax(s/T))`` per row), ``"mse"`` (``‖s − t‖²/‖t‖²`` per
            batch), or a callable ``loss(student, teacher) -> scalar Tensor``. With a 2-D
            ``attention_mask`` in a dict batch, outputs shaped ``(batch, tokens, …)`` are
            compared at the real tokens only, reduced to ``(real tokens, …)``.
        temperature: ``T`` of the ``"kl"`` loss.
        tokenizer, random_tokens: add ``random_tokens`` sequences of random ordinary tokens
            (:func:`~panther_lite.conversion.random_tokens.random_token_batches`, 16 tokens,
            batches of 32) to ``data``, on the model's device.
        max_steps: most optimizer steps, each on one training batch (reshuffled every pass).
        lr: Adam's learning rate (constant).
        holdout: fraction in (0, 1) of the batches held back (at least one, at most all but one).
        patience: stop after this many evaluations without a better held-back loss.
        eval_every: steps between evaluations (None: one pass over the training batches).
        seed: the order of the training batches.
        progress: a tqdm bar over the steps (None: on a terminal only).

    Returns:
        :class:`DistillationResult`; the model holds the parameters best on the held-back
        batches (its original ones when no evaluation beat them).

    Half precision: a float16/bfloat16 model runs in its dtype while Adam updates float32
    master copies of the trained parameters, rounded back each step (float16 with dynamic
    loss scaling, ``torch.amp.GradScaler``). The model trains in eval mode (no dropout);
    every module's mode, every parameter's ``requires_grad`` and the trained parameters'
    ``.grad`` are restored afterwards, also after an error or KeyboardInterrupt, which leave
    the model with the best parameters found so far.

    Memory and time: see :mod:`panther_lite.conversion.distillation`.

    Raises:
        TypeError / ValueError naming the argument, before anything is changed: ``model is
        teacher``, no sketched layer in ``model``, trained parameters shared with
        ``teacher``, empty or single-batch ``data``, a bad batch, outputs that differ in
        shape or are not floating-point tensors, a non-finite loss before training, and
        settings out of range (``lr <= 0``, ``holdout`` outside (0, 1), ...).
    """
    start = time.perf_counter()
    _check_models(model, teacher)
    train, settings = _check_train(train), _settings(max_steps, lr, patience, eval_every, seed)
    objective = Objective(check_outputs(outputs), check_loss(loss), check_temperature(temperature))
    holdout = check_holdout(holdout, "distill: ")
    parameters = _checked_parameters(model, teacher, train)
    session = _Session(model, teacher, _batches(data, model, tokenizer, random_tokens), holdout, objective)
    with evaluation_run(model):
        loss_before = session.held_loss()
    if loss_before == math.inf:
        raise ValueError("distill: the held-back loss before training is not finite; check data and the teacher's outputs")
    run = _Run(best_loss=loss_before, history=[(0, loss_before)])
    with only_these_train(model, parameters), best_kept(parameters) as best:
        _optimise(session, parameters, best, run, settings, progress)
    return DistillationResult(
        loss_before=loss_before,
        loss_after=run.best_loss,
        steps=run.steps,
        best_step=run.best_step,
        stopped_early=run.steps < settings.max_steps,
        stop_reason=run.stop_reason,
        loss=objective.kind,
        train_batches=len(session.train),
        held_batches=len(session.held),
        trained_elements=sum(parameter.numel() for parameter in parameters),
        seconds=time.perf_counter() - start,
        history=tuple(run.history),
    )
