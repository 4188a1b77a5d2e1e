"""Argument and numeric validation shared by the whole library (one message per kind of mistake).

Every check names the argument (and, for the numeric checks, optionally the layer) and
says what was expected, so a user can act on the error. Argument checks return the
normalised value; numeric checks return nothing and raise before anything is changed.
"""
from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

__all__ = [
    "check_bool",
    "is_real",
    "check_int",
    "check_positive_int",
    "check_nonnegative_int",
    "check_fraction",
    "check_choice",
    "check_int_tuple",
    "check_tensor",
    "check_materialized",
    "check_finite",
    "check_gram",
    "check_sketch_fits_a_tensor",
    "check_sketch_rank",
]

# Largest element count of one tensor (int64 sizes).
_MAX_TENSOR_ENTRIES = 2**63 - 1
# A sketch's total rank 2·L·k may exceed its larger side (the anchor's random sketches do,
# for variance), but not by more than this factor when read from an untrusted config.
MAX_RANK_OVER_SIDE = 16

# A calibration Gram may miss positive semi-definiteness by rounding: eigenvalues down to
# -_GRAM_TOLERANCE · mean(diag) pass (the fit adds a ridge of this order anyway).
_GRAM_TOLERANCE = 1e-4


def _where(layer: Optional[str]) -> str:
    return "" if layer is None else f"layer {layer!r}: "


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``value`` as an int within ``[minimum, maximum]`` (either bound optional).

    Any integer type is accepted (``numpy.int64``, ...); ``bool`` and floats are not.
    Raises ValueError naming ``name`` and the range.
    """
    bounds = (
        f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None else f"in [{minimum}, {maximum}]"
    )
    expected = "an integer" if minimum is None and maximum is None else f"an integer {bounds}"
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def check_bool(name: str, value) -> bool:
    """``value`` as a bool: True or False (a numpy bool too); TypeError naming ``name`` for
    anything else (``"no"``, ``0``, None: truthiness would read a string as True)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def is_real(value) -> bool:
    """Whether ``value`` is a real number a Python number could stand for: an int or float of
    any type (numpy's ``float32``, ``int64``, ...), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ not in ("bool_",)


def check_positive_int(name: str, value) -> int:
    """``value`` as an int ``>= 1`` (ValueError naming ``name`` otherwise)."""
    return check_int(name, value, minimum=1)


def check_nonnegative_int(name: str, value) -> int:
    """``value`` as an int ``>= 0`` (ValueError naming ``name`` otherwise)."""
    return check_int(name, value, minimum=0)


def check_fraction(name: str, value, what: str = "") -> float:
    """``value`` as a float in ``(0, 1]``; ``what`` (e.g. "stored size as a fraction of the
    dense layer") is added to the message."""
    ok = is_real(value) and 0 < value <= 1
    if not ok:
        meaning = f" ({what})" if what else ""
        raise ValueError(f"{name} must be a number in (0, 1]{meaning}, got {value!r}")
    return float(value)


def check_choice(name: str, value, choices: Sequence):
    """``value`` if it is one of ``choices`` (ValueError listing them otherwise)."""
    if value not in tuple(choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_int_tuple(name: str, value, length: int, minimum: int = 1) -> Tuple[int, ...]:
    """An int or a sequence of ``length`` ints, each ``>= minimum``, as a tuple of ``length``
    (an int is repeated, like ``nn.Conv2d``'s ``kernel_size=3`` → ``(3, 3)``)."""
    try:
        items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else (value,) * length
        if len(items) != length:
            raise ValueError
        return tuple(check_int(name, item, minimum=minimum) for item in items)
    except (TypeError, ValueError):
        kind = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f">= {minimum}"
        raise ValueError(f"{name} must be a {kind} int or a tuple of {length} such ints, got {value!r}") from None


def check_tensor(name: str, value, shape: Optional[Sequence[int]] = None, layout: str = "") -> Tensor:
    """``value`` if it is a Tensor (TypeError otherwise), not a lazy module's uninitialized
    parameter, of ``shape`` when given (ValueError naming ``layout``, e.g.
    ``"(out_features, in_features)"``, otherwise)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")
    _check_not_lazy(name, value)
    if shape is not None and tuple(value.shape) != tuple(shape):
        described = f"{layout} = " if layout else ""
        raise ValueError(f"{name} must have shape {described}{tuple(shape)}, got {tuple(value.shape)}")
    return value


def _check_not_lazy(name: str, tensor: Tensor, layer: Optional[str] = None) -> None:
    """ValueError if ``tensor`` is a lazy module's uninitialized parameter (no shape, no values)."""
    if is_lazy(tensor):
        raise ValueError(
            f"{_where(layer)}{name} is an uninitialized parameter of a lazy module (nn.LazyLinear, "
            "nn.LazyConv2d, ...): run a forward pass through the module first so it gets its shape and values"
        )


def check_materialized(name: str, tensor: Tensor, layer: Optional[str] = None) -> None:
    """ValueError if ``tensor`` has no values: a lazy module's uninitialized parameter (no
    shape yet either) or a tensor on the meta device (a shape but no values)."""
    _check_not_lazy(name, tensor, layer)
    if tensor.is_meta:
        raise ValueError(
            f"{_where(layer)}{name} is on the meta device and has no values to fit: materialise it first "
            "(e.g. module.to_empty(device=...) and load its weights), or build the sketched layer with "
            "device='meta' and load a state_dict into it"
        )


def all_finite(tensor: Tensor) -> bool:
    """Whether every entry of ``tensor`` is finite; a finite sum settles it without a temporary
    the size of ``tensor`` (a large Gram's), only an infinite or NaN sum is checked entry by entry."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(name: str, tensor: Tensor, layer: Optional[str] = None) -> None:
    """ValueError saying how many NaN/Inf entries ``tensor`` has, if any."""
    if tensor.is_meta or not tensor.is_floating_point() or all_finite(tensor):
        return
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        nans = int(torch.isnan(tensor).sum())
        infs = int(bad.sum()) - nans
        raise ValueError(
            f"{_where(layer)}{name} contains non-finite values ({nans} NaN, {infs} Inf of {tensor.numel()} "
            "entries); a low-rank fit of it would be NaN everywhere: fix or exclude this layer"
        )


def check_gram(
    gram: Tensor, fan_in: int, fan_in_name: str = "fan_in", layer: Optional[str] = None, name: str = "gram"
) -> None:
    """Check a calibration Gram ``XᵀX`` of shape ``(fan_in, fan_in)``: a Tensor, finite,
    symmetric and positive semi-definite up to rounding (smallest eigenvalue no lower than
    ``-1e-4·mean(diag)``, tested by a Cholesky factorisation of the shifted matrix in
    float64, its one full-size temporary: ``8·fan_in²`` bytes). Raises TypeError/ValueError naming ``name`` and ``layer``."""
    if not isinstance(gram, Tensor):
        raise TypeError(f"{_where(layer)}{name} must be a Tensor, got {type(gram).__name__}")
    if tuple(gram.shape) != (fan_in, fan_in):
        raise ValueError(
            f"{_where(layer)}{name} must have shape ({fan_in_name}, {fan_in_name}) = ({fan_in}, {fan_in}), "
            f"got {tuple(gram.shape)}"
        )
    check_materialized(name, gram, layer)
    check_finite(name, gram, layer)
    g = gram.detach()
    ridge = _GRAM_TOLERANCE * float(g.diagonal().abs().double().mean()) + torch.finfo(torch.float64).tiny
    if _largest_asymmetry(g) > ridge:
        raise ValueError(
            f"{_where(layer)}{name} is not symmetric; a Gram XᵀX of calibration inputs is (symmetrise it with "
            "(G + G.T) / 2 if the asymmetry is rounding)"
        )
    shifted = g.to(torch.float64, copy=True)  # the one full-size temporary: factorised in place
    shifted.diagonal().add_(ridge)
    info = torch.empty((), dtype=torch.int32, device=g.device)
    if int(torch.linalg.cholesky_ex(shifted, out=(shifted, info)).info) != 0:
        raise ValueError(
            f"{_where(layer)}{name} is not positive semi-definite (it has an eigenvalue below "
            f"-{_GRAM_TOLERANCE:g}·mean(diag)); a Gram XᵀX of calibration inputs always is: check how it was "
            "accumulated"
        )


def _largest_asymmetry(matrix: Tensor, block: int = 1024) -> float:
    """``max |M − Mᵀ|`` of a square matrix, a pair of blocks at a time (no full-size temporary)."""
    largest = 0.0
    for i in range(0, matrix.shape[0], block):
        for j in range(i, matrix.shape[0], block):
            upper, lower = matrix[i : i + block, j : j + block], matrix[j : j + block, i : i + block]
            largest = max(largest, float((upper.double() - lower.t().double()).abs().max()))
    return largest


def check_sketch_fits_a_tensor(num_terms: int, low_rank: int, fan_in: int, fan_out: int) -> None:
    """ValueError naming ``num_terms`` and ``low_rank`` when a sketch's stored factors
    (``2·L·k·(fan_in + fan_out)`` entries) could not be one tensor (int64 sizes overflow)."""
    entries = 2 * num_terms * low_rank * (fan_in + fan_out)
    if entries > _MAX_TENSOR_ENTRIES:
        raise ValueError(
            f"num_terms={num_terms} and low_rank={low_rank} give factors of {entries:.3g} entries "
            f"(fan_in={fan_in}, fan_out={fan_out}), more than a tensor can hold; lower num_terms * low_rank"
        )


def check_sketch_rank(num_terms: int, low_rank: int, fan_in: int, fan_out: int, layer: Optional[str] = None) -> None:
    """ValueError naming ``low_rank``/``num_terms`` (and the layer) when a sketch's ranks do not
    fit the layer's shape: ``low_rank`` above ``max(fan_in, fan_out)`` or the total rank
    ``2·L·k`` above :data:`MAX_RANK_OVER_SIDE` times it. Used on sizes read from files, so a
    tampered config fails before any memory is allocated."""
    side = max(fan_in, fan_out)
    shape = f"the layer's larger side {side} ({fan_in} -> {fan_out})"
    if low_rank > side:
        raise ValueError(f"{_where(layer)}low_rank={low_rank} exceeds {shape}")
    if 2 * num_terms * low_rank > MAX_RANK_OVER_SIDE * side:
        raise ValueError(
            f"{_where(layer)}num_terms={num_terms} with low_rank={low_rank} gives a total rank 2*num_terms*low_rank = "
            f"{2 * num_terms * low_rank:,}, over {MAX_RANK_OVER_SIDE}x {shape}"
        )
