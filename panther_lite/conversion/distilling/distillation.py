"""``panther_lite.distill``: end-to-end distillation of a converted model against the original.

The closed-form fits of :func:`~panther_lite.conversion.convert` are optimal layer by layer,
and block-wise refinement block by block; what they leave is the error the whole network
compounds. ``distill`` trains the converted model's sketched factors (optionally their biases
and the model's norms) with Adam so that its outputs match the original model's (the
teacher's) on calibration batches (and, with ``random_tokens``, batches of random tokens),
stopping when the loss on held-back batches stops improving and keeping the parameters best
there (Hinton et al. 2015; the last step of SVD-LLM-style compression pipelines).

Memory: the teacher and the student both (a float16/bfloat16 student held in float32 while it
trains, :mod:`~panther_lite.conversion.fitting.master_weights`), a copy of the trained
parameters (the best so far), their gradients and Adam's two moments, and one batch's
activations of both models (the student's kept for the backward). Time: each step is one teacher forward and one student
forward and backward on one batch; each evaluation is both forwards on every held-back batch.
With the teacher's outputs cached (:func:`~panther_lite.teacher_outputs`, passed as ``teacher``)
the teacher is not in memory and never runs: the cache (``8·k + 4`` bytes per real token for
top-``k`` logits) replaces it, and each step is the student's forward and backward alone.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ...nn.layer_base import SketchedLayer
from ..calibration.batches import evaluation_run
from ..config import configured
from ..fitting.autocast import resolve_autocast
from ..fitting.block_refinement import only_these_train
from ..fitting.master_weights import HALF_DTYPES, in_float32
from ..fitting.refinement import best_kept
from ..process_groups.distillation import batch_owner, check_cache_share
from ..process_groups.group import ProcessGroupRun, running_on
from ..process_groups.run import resolve_run
from .config import RANDOM_TOKEN_LENGTH, TRAINABLE, DistillConfig
from .memory import check_training_memory
from .objective import Objective
from .run import RandomTokens, Run, Session, data_batches, device_of, live_targets, on_device, optimise, warmup_steps
from .teacher_cache import TeacherOutputs

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["DistillationResult", "RANDOM_TOKEN_LENGTH", "TRAINABLE", "distill", "trained_parameters"]

@dataclass(frozen=True)
class DistillationResult:
    """What :func:`distill` did.

    ``loss_before`` / ``loss_after``: the mean loss over the held-back batches before training
    and with the parameters kept (``loss_after <= loss_before``: when no evaluation beats the
    start, every parameter is restored bit for bit); ``steps``: optimizer steps taken (one
    batch each); ``best_step``: the step whose parameters were kept (0: the original ones);
    ``stop_reason``: ``"max_steps"``, ``"max_minutes"`` (fewer steps fitted in the time limit),
    ``"patience"`` or ``"non-finite loss"``; ``stopped_early``: stopped before ``max_steps``;
    ``loss``: the loss used (``"mse"``, ``"kl"``, ``"callable"``); ``train_batches`` / ``held_batches``: how the batches were
    split; ``trained_elements``: parameter elements trained; ``seconds``: wall time;
    ``autocast``: the dtype the student ran in under ``torch.autocast`` (None: its own, float32);
    ``history``: ``(step, mean training loss since the previous evaluation, held-back loss)``
    at each evaluation, step 0 first (its training loss is NaN).
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
    autocast: Optional[torch.dtype] = None
    history: Tuple[Tuple[int, float, float], ...] = field(default=(), repr=False)

    def history_frame(self) -> "pd.DataFrame":
        """``history`` as a DataFrame with columns ``step``, ``train_loss`` and ``held_loss``."""
        import pandas as pd

        return pd.DataFrame(list(self.history), columns=["step", "train_loss", "held_loss"])


def _check_models(model, teacher) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"distill: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(teacher, (nn.Module, TeacherOutputs)):
        raise TypeError(f"distill: teacher must be an nn.Module or the TeacherOutputs of teacher_outputs, "
                        f"got {type(teacher).__name__}")
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


def _checked_parameters(model: nn.Module, teacher, train: Tuple[str, ...]) -> List[nn.Parameter]:
    parameters = trained_parameters(model, train)
    if not parameters:
        raise ValueError(f"distill: train={train} selects no parameter of model")
    if isinstance(teacher, TeacherOutputs):
        return parameters
    teachers = {id(tensor) for tensor in itertools.chain(teacher.parameters(), teacher.buffers())}
    widened = [t for t in itertools.chain(model.parameters(), model.buffers()) if t.dtype in HALF_DTYPES]
    if any(id(tensor) in teachers for tensor in itertools.chain(parameters, widened)):
        raise ValueError(
            "distill: model shares tensors it would train (or, in half precision, hold in float32) with teacher, "
            "so training would change the teacher; convert a copy.deepcopy of the original"
        )
    return parameters


def _check_memory(model: nn.Module, parameters: List[nn.Parameter]) -> None:
    """Refuse a model on the CPU that this machine's memory cannot train (:mod:`.memory`)."""
    if device_of(model).type == "cpu":
        elements = sum(tensor.numel() for tensor in itertools.chain(model.parameters(), model.buffers()))
        check_training_memory(elements, sum(parameter.numel() for parameter in parameters), "distill",
                              "train on a machine with more memory, or a GPU")


def _session(model: nn.Module, teacher, data, settings: DistillConfig, objective: Objective,
             run: Optional[ProcessGroupRun]) -> Session:
    """The batches and what they are compared with: ``teacher`` run live (the training random-token
    batches drawn afresh each pass), or its cached outputs (checked against ``data``; their random-token
    batches kept for every pass); across processes, which of them this rank runs."""
    batches, device = data_batches(data), device_of(model)
    if isinstance(teacher, TeacherOutputs):
        teacher.check(settings, batches)
        check_cache_share(teacher.share, run)
        batches += [on_device(batch, device) for batch in teacher.random_batches]
        random = RandomTokens(None, 0, settings.random_token_length, settings.seed, device)
        session = Session(model, teacher.target, batches, random, settings.holdout, objective)
    else:
        random = RandomTokens(settings.tokenizer, settings.random_tokens, settings.random_token_length, settings.seed,
                              device)
        session = Session(model, live_targets(teacher, objective), batches, random, settings.holdout, objective)
    session.owned = batch_owner(run, session.batches, "distill")
    return session


def distill(model: nn.Module, teacher: Union[nn.Module, TeacherOutputs], data, config: Optional[DistillConfig] = None,
            *, process_group=None, **overrides) -> DistillationResult:
    """Train ``model`` (converted, in place) to reproduce ``teacher``'s outputs (the original
    model, never modified); early stopping on held-back batches keeps the best parameters.

    Args:
        model: the converted model (the student); holds at least one sketched layer.
        teacher: the original model (run in eval mode under ``no_grad``; its parameters,
            buffers, modes and flags are left as they were), or its outputs on ``data`` cached
            by :func:`~panther_lite.teacher_outputs` with the same ``outputs``, ``loss`` and
            ``temperature`` (a top-``k`` cache of logits: the ``"kl"`` loss over the ``k``
            tokens and one bucket for the rest, :func:`~.objective.top_k_kl`); its
            random-token batches join ``data`` (``random_tokens`` here: 0 or the number cached).
        data: an iterable of batches as ``convert``'s ``calibration_data`` takes them
            (Tensor → ``model(b)``, tuple → ``model(*b)``, dict → ``model(**b)``); each runs
            through both models. A share ``holdout`` of them (with the random-token batches),
            spread evenly, is held back for early stopping; at least two batches in all.
        config: a :class:`~panther_lite.DistillConfig` holding the options (what trains, the
            loss, random tokens, the optimizer's steps and schedule, early stopping); None for
            its defaults.
        process_group: the ``torch.distributed`` group to distill across (None: the default
            group when ``torch.distributed`` is initialised, e.g. under ``torchrun``; one process
            otherwise). Every process passes the same model, teacher (or its cache, made on the
            same processes or in one) and all the batches; batch ``i`` runs on process
            ``i % world`` and a step is the one-process step (its batch's gradient, summed over the
            processes with zeros from the others), so every process ends with the one-process
            model (module :mod:`~panther_lite.conversion.distilling.run`).
        **overrides: :class:`~panther_lite.DistillConfig` fields (``max_steps=200``,
            ``lr=3e-4``, ...) replacing the ``config``'s; an unknown name is a TypeError naming
            the closest option.

        Examples:
        >>> import copy, torch, torch.nn as nn, panther_lite
        >>> teacher = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> model = copy.deepcopy(teacher)
        >>> batches = [torch.randn(16, 32) for _ in range(4)]
        >>> _ = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, progress=False)
        >>> config = panther_lite.DistillConfig(max_steps=20, lr=1e-2)
        >>> result = panther_lite.distill(model, teacher, batches, config, progress=False)
        >>> result.loss_after <= result.loss_before
        True

    Returns:
        :class:`DistillationResult`; the model holds the parameters best on the held-back
        batches (its original ones when no evaluation beat them).

    Half precision: a float16/bfloat16 student is held in float32 while it trains (float32
    master weights: its forward, backward and Adam's updates in float32, so small updates
    accumulate), the losses measured so, and rounded back to its dtype at the end; the
    teacher runs in its own dtype. With ``autocast``, the student's forwards and backwards (the
    held-back losses' too) run in bfloat16 or float16 under ``torch.autocast`` while the parameters
    and the optimizer stay in float32. The model trains in eval mode (no dropout);
    every module's mode, every parameter's ``requires_grad`` and the trained parameters'
    ``.grad`` are restored afterwards, also after an error or KeyboardInterrupt, which leave
    the model with the best parameters found so far.

    Memory and time: see :mod:`panther_lite.conversion.distilling.distillation`.

    Raises:
        TypeError / ValueError naming the argument, before anything is changed:
        ``model is teacher``, no sketched layer in ``model``, tensors the teacher shares that
        training would change (the trained ones; in half precision, any), empty or
        single-batch ``data``, a bad batch, ``data`` or settings other than a cache's, outputs that differ in shape or are not
        floating-point tensors, a non-finite loss before training, a model on the CPU that needs
        more than this machine's memory to train, and
        settings out of range (``lr <= 0``, ``holdout`` outside (0, 1), ...). Across processes,
        on every process: processes holding different batches, fewer batches (with the
        random-token ones) than processes, a cache holding another process's share.
    """
    start = time.perf_counter()
    settings = configured(DistillConfig, config, overrides, caller="distill")
    _check_models(model, teacher)
    objective = Objective(settings.outputs, settings.loss, settings.temperature)
    parameters = _checked_parameters(model, teacher, settings.train)
    _check_memory(model, parameters)
    run = resolve_run(process_group)
    session = _session(model, teacher, data, settings, objective, run)
    session.autocast = resolve_autocast(settings.autocast, session.device)
    with running_on(run), only_these_train(model, parameters), best_kept(parameters) as best, in_float32(model) as widened:
        session.widen = widened
        with evaluation_run(model):
            loss_before = session.held_loss()
        if loss_before == math.inf:
            raise ValueError("distill: the held-back loss before training is not finite; check data and the teacher's outputs")
        run = Run(loss_before, warmup=warmup_steps(settings.max_steps), history=[(0, math.nan, loss_before)])
        optimise(session, parameters, best, run, settings, settings.progress)
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
        autocast=session.autocast,
        history=tuple(run.history),
    )
