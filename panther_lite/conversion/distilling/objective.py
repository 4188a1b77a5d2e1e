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
from typing import Callable, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..calibration.tokens import batch_token_mask

__all__ = [
    "LOSSES", "Objective", "TopKLogProbs", "at_real_tokens", "check_loss", "check_outputs", "check_temperature",
    "real_tokens", "relative_squared_error", "select_output", "softened_kl", "top_k_kl", "top_k_log_probs",
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


def at_real_tokens(batch, selected: Tensor) -> Tensor:
    """``selected`` at the batch's real tokens (:func:`real_tokens`; all of it without a mask)."""
    mask = real_tokens(batch, selected)
    if mask is None:
        return selected
    # all real: the same rows as a view, sparing a copy of the logits and a scatter back in backward
    return selected.flatten(0, 1) if bool(mask.all()) else selected[mask]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else float32: the loss of a half-precision model is summed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _widened(tensor: Tensor) -> Tensor:
    """``tensor`` in at least float32 (:func:`_wide`)."""
    return tensor.to(_wide(tensor.dtype))


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


class TopKLogProbs(NamedTuple):
    """A teacher's distribution over the last dimension (the vocabulary), kept as its ``k`` most
    likely entries per row: ``log_probs`` (rows, k), ``log_softmax(t/T)`` there (the softmax
    taken over the whole vocabulary); ``indices`` (rows, k), int32, where they lie; ``tail``
    (rows,), the log of the mass left, ``log(1 − Σ exp(log_probs))``, or None when ``k`` is the
    whole vocabulary (nothing is left)."""

    log_probs: Tensor
    indices: Tensor
    tail: Optional[Tensor]

    def stored(self) -> "TopKLogProbs":
        """These log-probabilities as a cache keeps them: float32, on the CPU."""
        tail = None if self.tail is None else self.tail.float().cpu()
        return TopKLogProbs(self.log_probs.float().cpu(), self.indices.cpu(), tail)


def top_k_log_probs(rows: Tensor, k: int, temperature: float) -> TopKLogProbs:
    """The :class:`TopKLogProbs` of the logits ``rows`` (rows, vocabulary) at temperature ``T``
    (``k`` above the vocabulary: all of it), in at least float32; the tail is the log-sum-exp of
    the log-probabilities left out, so it is exact however small.

    Examples:
        >>> kept = top_k_log_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 2, temperature=1.0)
        >>> kept.indices.tolist(), round(float(kept.tail.exp() + kept.log_probs.exp().sum()), 6)
        ([[0, 1]], 1.0)
    """
    log_probs = F.log_softmax(_widened(rows) / temperature, dim=-1)
    k = min(k, rows.shape[-1])
    values, indices = log_probs.topk(k, dim=-1)
    tail = None if k == rows.shape[-1] else log_probs.scatter(-1, indices, -math.inf).logsumexp(-1)
    return TopKLogProbs(values, indices.to(torch.int32), tail)


def top_k_kl(student: Tensor, teacher: TopKLogProbs, temperature: float) -> Tensor:
    """``T² · KL(teacher ‖ student)`` over the ``k + 1`` buckets of ``teacher`` (its ``k`` tokens
    and the tail holding the rest), averaged over the rows: the student's logits ``student``
    (rows, vocabulary) give ``log_softmax(s/T)`` at the same ``k`` tokens and, as its tail, the
    log of the mass left, ``log(1 − Σ_k q)`` (:func:`_student_tail`). With ``k`` the whole
    vocabulary it is :func:`softened_kl`.

    Examples:
        >>> s, t = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
        >>> full = top_k_kl(s, top_k_log_probs(t, 10, 2.0), 2.0)
        >>> bool(torch.isclose(full, softened_kl(s, t, 2.0), rtol=1e-12))
        True
    """
    if student.shape[0] == 0:
        return student.sum()
    indices = teacher.indices.to(student.device, torch.int64)
    wide = _wide(student.dtype)
    kept = teacher.log_probs.to(student.device, wide)
    tail = None if teacher.tail is None else teacher.tail.to(student.device, wide)
    return _TopKDivergence.apply(student, kept, indices, tail, temperature)


_LOGSUMEXP_CHUNK_BYTES = 1 << 24  # per-chunk temporaries under glibc's 32 MiB mmap threshold are reused, not faulted in afresh
# 1 − Σ_k q carries the normaliser's rounding, about 10·eps absolute: below 10⁵·eps (float32: 1.2%)
# its relative error could pass 1e-4, so those rows' tails are summed exactly
_EXACT_TAIL_BELOW_EPS = 1e5


def _chunked_logsumexp(rows: Tensor, temperature: float) -> Tensor:
    """``logsumexp(rows / T)`` over the last dimension, (rows,), in at least float32, a few rows at a time."""
    step = max(1, _LOGSUMEXP_CHUNK_BYTES // max(1, rows.shape[-1] * 4))
    return torch.cat([(_widened(chunk) / temperature).logsumexp(-1) for chunk in rows.split(step)])


def _student_tail(student: Tensor, indices: Tensor, kept: Tensor, normaliser: Tensor, temperature: float) -> Tensor:
    """``log(1 − Σ_k q)``, (rows,), the student's log-mass outside the teacher's ``k`` tokens, from
    its log-probabilities ``kept`` there. Where that mass is too small for the difference to stay
    exact at the logits' precision, the log-sum-exp of the other logits instead (those rows only)."""
    left = -torch.expm1(kept.double().logsumexp(-1))
    tail = torch.log(left.clamp_min(0)).to(kept.dtype)
    small = (left < _EXACT_TAIL_BELOW_EPS * torch.finfo(kept.dtype).eps).nonzero().squeeze(-1)
    if small.numel():
        others = (_widened(student[small]) / temperature).scatter(-1, indices[small], -math.inf)
        tail[small] = others.logsumexp(-1) - normaliser[small]
    return tail


class _TopKDivergence(torch.autograd.Function):
    """``top_k_kl`` with a backward written out, so the (rows, vocabulary) logits are read a few
    times and written once: with ``q = softmax(s/T)``, ``P`` the teacher's total mass,
    ``p_t / q_t`` the ratio of the tails, the gradient in ``s/T`` of a row's divergence is
    ``(P − p_t/q_t)·q`` off the ``k`` tokens and ``P·q − p`` on them (the teacher's ``k`` indices
    are distinct)."""

    @staticmethod
    def forward(ctx, student, kept, indices, tail, temperature):
        normaliser = _chunked_logsumexp(student, temperature)
        student_kept = _widened(student.gather(-1, indices)) / temperature - normaliser.unsqueeze(-1)
        divergence = (kept.exp() * (kept - student_kept)).sum(-1)
        ratio = torch.zeros_like(normaliser)
        if tail is not None:
            student_tail = _student_tail(student, indices, student_kept, normaliser, temperature)
            # a teacher tail of no mass (its other logits -inf) adds 0, not 0·inf
            has_tail = tail > -math.inf
            divergence = divergence + torch.where(has_tail, tail.exp() * (tail - student_tail), 0.0)
            ratio = torch.where(has_tail, (tail - student_tail).exp(), 0.0)
        ctx.temperature = temperature
        ctx.save_for_backward(student, kept, indices, tail, normaliser, student_kept, ratio)
        return divergence.sum() / student.shape[0] * temperature**2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        student, kept, indices, tail, normaliser, student_kept, ratio = ctx.saved_tensors
        temperature = ctx.temperature
        scale = grad * temperature / student.shape[0]
        kept_mass = kept.exp()
        total = kept_mass.sum(-1) + (0.0 if tail is None else tail.exp())
        probs = torch.empty(student.shape, dtype=normaliser.dtype, device=student.device)
        torch.sub(student, temperature * normaliser.unsqueeze(-1), out=probs)
        probs = (probs if temperature == 1 else probs.div_(temperature)).exp_()
        probs.mul_((scale * (total - ratio)).unsqueeze(-1))
        # on the k tokens written, not added: (P − p_t/q_t)·q + (p_t/q_t)·q would cancel when q_t is tiny
        probs.scatter_(-1, indices, scale * (total.unsqueeze(-1) * student_kept.exp() - kept_mass))
        return probs.to(student.dtype), None, None, None, None


class Objective:
    """``objective(batch, student_output, target)``: the loss of one batch, a scalar tensor with
    a graph to the student's parameters, against ``target``, the teacher's selected output
    (:meth:`target`) or its cached :class:`TopKLogProbs` at the batch's real tokens. ``kind`` is
    the loss used (``"mse"``, ``"kl"`` or ``"callable"``), known after the first call under ``"auto"``."""

    def __init__(self, outputs: OutputSelector, loss, temperature: float) -> None:
        self.outputs, self.loss, self.temperature = outputs, loss, temperature
        self.kind = "callable" if callable(loss) else None if loss == "auto" else loss

    def target(self, teacher_output) -> Tensor:
        """The teacher's output that is compared, detached."""
        return select_output(teacher_output, self.outputs, "teacher")[0].detach()

    def __call__(self, batch, student_output, target: Union[Tensor, TopKLogProbs]) -> Tensor:
        student, name = select_output(student_output, self.outputs, "model")
        if isinstance(target, TopKLogProbs):
            self.kind = self.kind or "kl"
            rows = at_real_tokens(batch, student).reshape(-1, student.shape[-1])
            if rows.shape[0] != target.indices.shape[0]:
                raise ValueError(f"distill: the batch has {rows.shape[0]} real tokens and the teacher's cached "
                                 f"outputs {target.indices.shape[0]}; pass the batches teacher_outputs ran")
            return top_k_kl(rows, target, self.temperature)
        if student.shape != target.shape:
            raise ValueError(
                f"distill: the model's output {tuple(student.shape)} and the teacher's {tuple(target.shape)} differ "
                f"in shape (outputs={self.outputs!r}); compare outputs of the same shape (pass outputs=)"
            )
        if self.kind is None:
            self.kind = "kl" if name == "logits" else "mse"
        teacher = target.to(student.device)
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
