"""Tensor-core-aligned rank selection and the parameter accounting of sketched layers.

Both layers store ``2·L·k·(fan_in + fan_out)`` factor entries plus the bias (for SKLinear
half of the factors are trainable and half fixed sketch buffers; for SKConv2d the input-side
``2Lk·fan_in`` are trainable, see ``conv_sketch_size``), where ``fan_in`` is ``in_features`` (SKLinear) or
``C_in·kh·kw`` (SKConv2d) and ``fan_out`` is ``out_features`` / ``C_out``. The dense layer
stores ``fan_in·fan_out`` plus the bias. Cost depends on ``L·k`` only, so a budget fixes
``L·k`` and ``num_terms`` only decides how it is split.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

__all__ = [
    "tensor_core_multiple",
    "align_rank",
    "SketchSize",
    "sketch_size",
    "dense_size",
    "select_config",
    "largest_rank",
    "tensor_cores_apply",
    "resolve_rank_multiple",
    "MAX_ALIGNMENT_WASTE",
]

MAX_ALIGNMENT_WASTE = 0.1
"""Largest share of a layer's budget that rounding ``low_rank`` to a multiple may leave unused."""

_MULTIPLE_BY_DTYPE = {
    torch.float16: 8,
    torch.bfloat16: 8,
    torch.float32: 4,
    torch.float64: 1,
    torch.int8: 16,
    torch.uint8: 16,
}


def tensor_core_multiple(dtype: Optional[torch.dtype] = None) -> int:
    """The multiple a GEMM dimension wants for tensor cores at ``dtype``.

    8 for fp16/bf16, 16 for int8 and the float8 types, 4 for float32 (TF32), 1 for
    float64 (no tensor-core path). ``None`` means the default dtype.
    """
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype in _MULTIPLE_BY_DTYPE:
        return _MULTIPLE_BY_DTYPE[dtype]
    if "float8" in str(dtype):
        return 16
    raise ValueError(f"no tensor-core multiple known for dtype {dtype}")


def align_rank(rank: int, multiple: int) -> int:
    """``rank`` rounded down to a multiple of ``multiple``, unless that would give 0."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    aligned = (rank // multiple) * multiple
    return aligned if aligned > 0 else rank


@dataclass(frozen=True)
class SketchSize:
    """Parameter counts of one layer: ``trainable`` (S factors + bias) and ``stored``
    (``trainable`` plus the fixed U sketch buffers)."""

    trainable: int
    stored: int


def sketch_size(fan_in: int, fan_out: int, num_terms: int, low_rank: int, bias: bool = True) -> SketchSize:
    """Trainable and stored entries of a sketched layer (see module docstring)."""
    half = num_terms * low_rank * (fan_in + fan_out)
    b = fan_out if bias else 0
    return SketchSize(trainable=half + b, stored=2 * half + b)


def dense_size(fan_in: int, fan_out: int, bias: bool = True) -> int:
    """Entries of the dense layer: ``fan_in·fan_out`` (+ ``fan_out`` bias)."""
    return fan_in * fan_out + (fan_out if bias else 0)


def tensor_cores_apply(device: Optional[torch.device], dtype: Optional[torch.dtype]) -> bool:
    """Whether a GEMM of ``dtype`` on ``device`` runs on tensor cores: CUDA with fp16/bf16,
    int8 or float8, or float32 while TF32 matmuls are allowed
    (``torch.backends.cuda.matmul.allow_tf32``). Never on CPU or for float64."""
    if device is None or torch.device(device).type != "cuda" or dtype is None:
        return False
    if dtype == torch.float32:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return dtype != torch.float64 and (dtype in _MULTIPLE_BY_DTYPE or "float8" in str(dtype))


def resolve_rank_multiple(align: Union[None, str, int], device: Optional[torch.device], dtype: Optional[torch.dtype]) -> int:
    """The multiple ``low_rank`` is rounded to for a layer on ``device`` at ``dtype``.

    ``align="auto"``: :func:`tensor_core_multiple` of ``dtype`` where the layer runs on tensor
    cores (:func:`tensor_cores_apply`), else 1; ``None``: 1 (no rounding); an int ``m >= 1``: ``m``.
    """
    if align is None:
        return 1
    if align == "auto":
        return tensor_core_multiple(dtype) if tensor_cores_apply(device, dtype) else 1
    if isinstance(align, bool) or not isinstance(align, numbers.Integral) or align < 1:
        raise ValueError(f'align must be None, "auto" or an integer >= 1, got {align!r}')
    return int(align)


def largest_rank(fan_in: int, fan_out: int, budget: float, *, num_terms: int = 1, bias: bool = True) -> int:
    """The largest ``low_rank`` whose stored size is at most ``budget`` entries (0 if none)."""
    rank = int((budget - (fan_out if bias else 0)) // (2 * num_terms * (fan_in + fan_out)))
    while rank >= 1 and sketch_size(fan_in, fan_out, num_terms, rank, bias).stored > budget:
        rank -= 1  # guards the float division above against rounding up
    return max(rank, 0)


def select_config(
    fan_in: int,
    fan_out: int,
    param_ratio: float,
    *,
    num_terms: int = 1,
    dtype: Optional[torch.dtype] = None,
    bias: bool = True,
    multiple: Optional[int] = None,
    max_waste: float = MAX_ALIGNMENT_WASTE,
) -> Optional[Tuple[int, int]]:
    """Choose ``(num_terms, low_rank)`` whose *stored* size is at most ``param_ratio`` of
    the dense layer's, filling that budget.

    ``low_rank`` is the largest rank that fits, rounded down to ``multiple`` when the rounded
    rank is nonzero and still stores at least ``1 - max_waste`` (default 90%) of the budget;
    otherwise the largest is kept. ``multiple`` defaults to
    :func:`tensor_core_multiple` of ``dtype`` when ``dtype`` is given, else 1 (no rounding;
    :func:`resolve_rank_multiple` says when a layer runs on tensor cores). Returns None when
    not even ``low_rank = 1`` fits the budget.
    """
    if not param_ratio > 0:
        raise ValueError(f"param_ratio must be > 0, got {param_ratio}")
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    if multiple is None:
        multiple = 1 if dtype is None else tensor_core_multiple(dtype)
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if not 0 <= max_waste <= 1:
        raise ValueError(f"max_waste must be in [0, 1], got {max_waste}")
    budget = param_ratio * dense_size(fan_in, fan_out, bias)
    low_rank = largest_rank(fan_in, fan_out, budget, num_terms=num_terms, bias=bias)
    if low_rank < 1:
        return None
    aligned = align_rank(low_rank, multiple)
    filled = sketch_size(fan_in, fan_out, num_terms, aligned, bias).stored >= (1 - max_waste) * budget
    return num_terms, (aligned if filled else low_rank)
