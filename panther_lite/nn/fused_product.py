"""The stacked schedule in one Triton kernel: ``scale·(x·[S1 | U2])·[U1; S2] (+ bias)`` with the rank-``2Lk`` intermediate kept on chip.

Two cuBLAS GEMMs read ``x``, write the ``(rows, 2Lk)`` intermediate to memory, read it back and
write ``y``; for a small rank the layer is bound by memory traffic, and on an H100 those two GEMMs
reached 0.60–0.69 of the memory roofline (``benchmarks/results/cuda/NOTES.md``). This kernel
streams a block of rows of ``x`` once, keeps its intermediate in registers and writes its rows
of ``y`` once: each program owns ``BLOCK_ROWS`` rows, accumulates ``x·left`` over the input
width, then multiplies by ``right`` one block of outputs at a time.

Not yet the layer's route: it has run only in Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU), where its results are tested against :func:`~panther_lite.nn.functional.stacked_rows_forward`.
The interpreter (Triton 3.9) multiplies bfloat16 blocks wrongly, so there the operands are widened
to float32 first (``WIDEN``): exact products accumulated in float32, what tensor cores compute.
``benchmarks/bench_fused_product.py`` (``scripts/gpu_suite.sh fused``) measures it against the
two GEMMs on a GPU; it becomes the CUDA route where that measures it faster. Triton is optional:
:func:`fused_available` says whether it can run here.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is an optional extra
    triton = tl = None

__all__ = ["fused_available", "fused_stacked_product"]

BLOCK_ROWS, BLOCK_INPUTS, BLOCK_OUTPUTS = 32, 32, 64
LARGEST_RANK = 256  # the intermediate (BLOCK_ROWS × rank, float32) must fit a program's registers


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_available(x: Tensor) -> bool:
    """Whether :func:`fused_stacked_product` can run on ``x``: Triton is installed and ``x`` is on a
    CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


def _stacked_kernel(x_ptr, left_ptr, right_ptr, bias_ptr, y_ptr, rows, inputs, outputs, rank, scale,
                    x_row, x_col, left_row, left_col, right_row, right_col, y_row, y_col,
                    HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr, RANK: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BLOCK_INPUTS: tl.constexpr, BLOCK_OUTPUTS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    hidden_col = tl.arange(0, RANK)
    # tl.full, not tl.zeros: tl.zeros is itself jitted, compiled or interpreted as Triton was imported,
    # and the tests turn the interpreter on later
    hidden = tl.full((BLOCK_ROWS, RANK), 0.0, tl.float32)
    for start in range(0, inputs, BLOCK_INPUTS):
        col = start + tl.arange(0, BLOCK_INPUTS)
        x = tl.load(x_ptr + row[:, None] * x_row + col[None, :] * x_col,
                    mask=(row[:, None] < rows) & (col[None, :] < inputs), other=0.0)
        left = tl.load(left_ptr + col[:, None] * left_row + hidden_col[None, :] * left_col,
                       mask=(col[:, None] < inputs) & (hidden_col[None, :] < rank), other=0.0)
        if WIDEN:
            x, left = x.to(tl.float32), left.to(tl.float32)
        hidden += tl.dot(x, left, input_precision=PRECISION)
    hidden = hidden.to(y_ptr.dtype.element_ty)  # rounded as the two GEMMs round their intermediate
    for start in range(0, outputs, BLOCK_OUTPUTS):
        col = start + tl.arange(0, BLOCK_OUTPUTS)
        right = tl.load(right_ptr + hidden_col[:, None] * right_row + col[None, :] * right_col,
                        mask=(hidden_col[:, None] < rank) & (col[None, :] < outputs), other=0.0)
        if WIDEN:
            y = tl.dot(hidden.to(tl.float32), right.to(tl.float32), input_precision=PRECISION) * scale
        else:
            y = tl.dot(hidden, right, input_precision=PRECISION) * scale
        if HAS_BIAS:
            y += tl.load(bias_ptr + col, mask=col < outputs, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + row[:, None] * y_row + col[None, :] * y_col, y.to(y_ptr.dtype.element_ty),
                 mask=(row[:, None] < rows) & (col[None, :] < outputs))


def _precision(x: Tensor) -> str:
    """How ``tl.dot`` multiplies float32 blocks: TensorFloat-32 only where torch's own float32
    matmuls may (``torch.backends.cuda.matmul.allow_tf32``), else exactly, as cuBLAS does."""
    exact = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return "ieee" if exact else "tf32"


@functools.lru_cache(maxsize=2)
def _compiled(interpreted: bool):
    """The kernel, jitted for the GPU or for the interpreter: ``triton.jit`` reads ``TRITON_INTERPRET``
    when it is called, so the cache is keyed by that mode (``interpreted``)."""
    return triton.jit(_stacked_kernel)


def fused_stacked_product(x: Tensor, left: Tensor, right: Tensor, bias: Optional[Tensor], scale: float) -> Tensor:
    """``scale · (x·left)·right (+ bias)``, what :func:`~panther_lite.nn.functional.stacked_rows_forward`
    returns first, in one kernel.

    Args:
        x: ``(rows, in)``.
        left: ``[S1 | U2]``, ``(in, R)`` with ``R = 2Lk <= 256``.
        right: ``[U1; S2]``, ``(R, out)``.
        bias: ``(out,)`` or None.
        scale: the layer's ``1/(2L)``.

    Returns:
        ``(rows, out)`` in ``x``'s dtype; the products accumulate in float32.

    Example::

        y = fused_stacked_product(x, torch.cat((S1, U2), 1), torch.cat((U1, S2), 0), bias, 1 / (2 * L))
    """
    if not fused_available(x):
        raise RuntimeError("fused_stacked_product needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 on the CPU)")
    rank = left.shape[1]
    if x.dim() != 2 or left.shape[0] != x.shape[1] or right.shape[0] != rank or rank > LARGEST_RANK:
        raise ValueError(f"fused_stacked_product: expected x (rows, in), left (in, R <= {LARGEST_RANK}) and right "
                         f"(R, out), got {tuple(x.shape)}, {tuple(left.shape)} and {tuple(right.shape)}")
    rows, outputs = x.shape[0], right.shape[1]
    y = x.new_empty(rows, outputs)
    padded = max(16, triton.next_power_of_2(rank))  # tl.dot takes power-of-two blocks of 16 or more
    _compiled(_interpreted())[(triton.cdiv(rows, BLOCK_ROWS),)](
        x, left, right, bias if bias is not None else y, y, rows, x.shape[1], outputs, rank, float(scale),
        *x.stride(), *left.stride(), *right.stride(), *y.stride(),
        HAS_BIAS=bias is not None, WIDEN=_interpreted() and x.dtype == torch.bfloat16, PRECISION=_precision(x),
        RANK=padded, BLOCK_ROWS=BLOCK_ROWS, BLOCK_INPUTS=BLOCK_INPUTS,
        BLOCK_OUTPUTS=BLOCK_OUTPUTS,
    )
    return y
