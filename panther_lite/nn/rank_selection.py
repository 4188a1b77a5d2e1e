"""Tensor-core-aligned rank selection and the parameter accounting of sketched layers.

Both layers store ``2·L·k·(fan_in + fan_out)`` factor entries plus the bias (for SKLinear
half of the factors are trainable and half fixed sketch buffers; for SKConv2d the input-side
``2Lk·fan_in`` are trainable, see ``conv_sketch_size``), where ``fan_in`` is ``in_features`` (SKLinear) or
``C_in·kh·kw`` (SKConv2d) and ``fan_out`` is ``out_features`` / ``C_out``. The dense layer
stores ``fan_in·fan_out`` plus the bias. Cost depends on ``L·k`` only, so a budget fixes
``L·k`` and ``num_terms`` only decides how it is split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "tensor_core_multiple",
    "align_rank",
    "SketchSize",
    "sketch_size",
    "dense_size",
    "select_config",
]

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


def select_config(
    fan_in: int,
    fan_out: int,
    param_ratio: float,
    *,
    num_terms: int = 1,
    dtype: Optional[torch.dtype] = None,
    bias: bool = True,
) -> Optional[tuple]:
    """Choose ``(num_terms, low_rank)`` whose *stored* size is at most ``param_ratio`` of
    the dense layer's.

    ``low_rank`` is the largest rank that fits, rounded down to
    :func:`tensor_core_multiple` of ``dtype`` when that leaves a nonzero rank. Returns
    None when not even ``low_rank = 1`` fits the budget.
    """
    if not param_ratio > 0:
        raise ValueError(f"param_ratio must be > 0, got {param_ratio}")
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    budget = param_ratio * dense_size(fan_in, fan_out, bias) - (fan_out if bias else 0)
    low_rank = int(budget // (2 * num_terms * (fan_in + fan_out)))
    limit = param_ratio * dense_size(fan_in, fan_out, bias)
    while low_rank >= 1 and sketch_size(fan_in, fan_out, num_terms, low_rank, bias).stored > limit:
        low_rank -= 1  # guards the float division above against rounding up
    if low_rank < 1:
        return None
    return num_terms, align_rank(low_rank, tensor_core_multiple(dtype))
