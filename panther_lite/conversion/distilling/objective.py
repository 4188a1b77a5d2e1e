"""What distillation compares: each model's selected output on a batch, restricted to the
batch's real tokens, and the loss between the student's and the teacher's.

The output compared (``outputs``): by default a Tensor output itself, else the ``logits``
of a language model, else the ``last_hidden_state`` of an encoder, else the first tensor of
a tuple; a string names another key or attribute, an int another position, a callable
``outputs(model_output) -> Tensor`` anything else. The loss (``loss``): ``"auto"`` is
``"kl"`` for logits and ``"mse"`` otherwise; ``"kl"`` is the temperature-softened
Kullback–Leibler divergence of Hinton et al. (2015), ``T² · KL(softmax(t/T) ‖ softmax(s/T))``
per row; ``"mse"`` the squared error relative to the teacher's energy,
``‖s − t‖² / ‖t‖²`` (scale-free, so one learning rate fits every model); a callable
``loss(student, teacher) -> scalar Tensor`` anything else.

With an ``attention_mask`` in a dict batch, a selected output shaped ``(batch, tokens, …)``
is compared at the real tokens only (mask ≠ 0): both outputs are reduced to
``(real tokens, …)`` before the loss, a callable loss included, so padding never counts.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..calibration.tokens import batch_token_mask

__all__ = [
    "LOSSES", "Objective", "check_loss", "check_outputs", "check_temperature", "real_tokens", "relative_squared_error",
    "select_output", "softened_kl",
]

LOSSES = ("auto", "mse", "kl")
_AUTO_KEYS = ("logits", "last_hidden_state")

OutputSelector = Union[None, str, int, Callable[[object], Tensor]]


def check_outputs(outputs) -> OutputSelector:
    """``outputs`` when it is None, a str, an int or a callable (TypeError otherwise)."""
    if outputs is None or callable(outputs) or isinstance(outputs, str):
        return outputs
    if isinstance(outputs, numbers.Integral) and not isinstance(outputs, bool):
        return int(outputs)
    raise TypeError(
        "distill: outputs must be None (logits, else last_hidden_state, else the output tensor), a key or "
        f"attribute name, a tuple position or a callable outputs(model_output) -> Tensor, got {outputs!r}"
    )


def check_loss(loss):
    """``loss`` when it is one of :data:`LOSSES` or a callable (ValueError / TypeError otherwise)."""
    if callable(loss):
        return loss
    if isinstance(loss, str) and loss in LOSSES:
        return loss
    raise ValueError(f"distill: loss must be one of {LOSSES} or a callable loss(student, teacher) -> Tensor, got {loss!r}")


def check_temperature(temperature) -> float:
    """``temperature`` as a float when it is a positive finite number (ValueError otherwise)."""
    ok = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
    if not (ok and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"distill: temperature must be a positive finite number, got {temperature!r}")
    return float(temperature)


def _by_name(output, name: str):
    if isinstance(output, Mapping):
        return output[name] if name in output else None
    return getattr(output, name, None)


def _describe(output) -> str:
    if isinstance(output, Mapping):
        return f"{type(output).__name__} with keys {list(output)}"
    if isinstance(output, (tuple, list)):
        return f"{type(output).__name__} of {len(output)}"
    return type(output).__name__


def _auto(output) -> Tuple[object, Optional[str]]:
    """The tensor the default selector picks, and the name it was found under."""
    if isinstance(output, Tensor):
        return output, None
    for name in _AUTO_KEYS:
        value = _by_name(output, name)
        if value is not None:
            return value, name
    if isinstance(output, (tuple, list)):
        return next((value for value in output if isinstance(value, Tensor)), None), None
    return None, None


def select_output(output, outputs: OutputSelector, who: str) -> Tuple[Tensor, Optional[str]]:
    """The tensor of ``output`` (one model call's result) that ``outputs`` selects, and the
    key it was found under (None for a position, a callable or a bare tensor); ``who``
    ("model" / "teacher") goes into the errors."""
    if callable(outputs):
        value, name = outputs(output), None
    elif outputs is None:
        value, name = _auto(output)
    elif isinstance(outputs, str):
        value, name = _by_name(output, outputs), outputs
    else:
        items = output.to_tuple() if hasattr(output, "to_tuple") else output
        value = items[outputs] if isinstance(items, (tuple, list)) and -len(items) <= outputs < len(items) else None
        name = None
    if not isinstance(value, Tensor) or not value.is_floating_point():
        got = "nothing" if value is None else f"{type(value).__name__} {getattr(value, 'dtype', '')}".strip()
        raise ValueError(
            f"distill: outputs={outputs!r} selects {got} from the {who}'s output ({_describe(output)}); "
            "it must select a floating-point Tensor (pass outputs= a key, a position or a callable)"
        )
    return value, name


def real_tokens(batch, selected: Tensor) -> Optional[Tensor]:
    """The boolean ``(batch, tokens)`` mask of real tokens when ``batch`` carries one
    (:func:`~panther_lite.conversion.calibration.tokens.batch_token_mask`: a dict batch's 2-D
    ``attention_mask``) matching ``selected``'s first two dimensions; else None (all count)."""
    mask = batch_token_mask(batch)
    if mask is None or selected.dim() < 3 or selected.shape[:2] != mask.shape:
        return None
    return mask.to(selected.device)


def _widened(tensor: Tensor) -> Tensor:
    """At least float32 (the loss of a half-precision model is summed in float32)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def relative_squared_error(student: Tensor, teacher: Tensor) -> Tensor:
    """``‖s − t‖² / ‖t‖²`` in at least float32 (0 when the teacher's output is zero and the
    student's is too)."""
    student, teacher = _widened(student), _widened(teacher)
    energy = teacher.square().sum().clamp_min(torch.finfo(teacher.dtype).tiny)
    return (student - teacher).square().sum() / energy


def softened_kl(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``T² · KL(softmax(t/T) ‖ softmax(s/T))`` over the last dimension, averaged over the rows."""
    rows = student.reshape(-1, student.shape[-1])
    if rows.shape[0] == 0:
        return rows.sum()
    student = F.log_softmax(_widened(rows) / temperature, dim=-1)
    teacher = F.log_softmax(_widened(teacher.reshape(rows.shape)) / temperature, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


class Objective:
    """``objective(batch, student_output, teacher_output)``: the loss of one batch, a scalar
    tensor with a graph to the student's parameters. ``kind`` is the loss used
    (``"mse"``, ``"kl"`` or ``"callable"``), known after the first call under ``"auto"``."""

    def __init__(self, outputs: OutputSelector, loss, temperature: float) -> None:
        self.outputs, self.loss, self.temperature = outputs, loss, temperature
        self.kind = "callable" if callable(loss) else None if loss == "auto" else loss

    def __call__(self, batch, student_output, teacher_output) -> Tensor:
        student, name = select_output(student_output, self.outputs, "model")
        teacher = select_output(teacher_output, self.outputs, "teacher")[0].detach()
        if student.shape != teacher.shape:
            raise ValueError(
                f"distill: the model's output {tuple(student.shape)} and the teacher's {tuple(teacher.shape)} differ "
                f"in shape (outputs={self.outputs!r}); compare outputs of the same shape (pass outputs=)"
            )
        if self.kind is None:
            self.kind = "kl" if name == "logits" else "mse"
        teacher = teacher.to(student.device)
        mask = real_tokens(batch, student)
        if mask is not None:
            student, teacher = student[mask], teacher[mask]
        if self.kind == "callable":
            value = self.loss(student, teacher)
            if not isinstance(value, Tensor) or value.dim() != 0 or not value.is_floating_point():
                raise TypeError(f"distill: loss(student, teacher) must return a floating-point scalar Tensor, got {value!r}")
            return value
        if self.kind == "kl":
            return softened_kl(student, teacher, self.temperature)
        return relative_squared_error(student, teacher)
