"""oneDNN-prepacked right-hand factors for bfloat16 products on CPU, where each plain call pays a setup.

A bfloat16 ``torch.mm`` on CPU goes through ATen's oneDNN matmul, which describes the operands
and looks up its primitive on every call: measured on a 2-core AMD EPYC (AVX-512 BF16, one
thread), a ``1×576 · 576×250`` product spends about 8 µs in oneDNN's kernel and 17–23 µs in
``aten::mm``. A sketched layer makes two such calls where a dense one makes one, so at small
widths (SmolLM2: 576, ranks 86–125) this setup, not the bytes read, sets the decode speed.
``torch.ops.mkldnn._linear_pointwise`` on a weight packed once by
``torch.ops.mkldnn._reorder_linear_weight`` (what inductor's freezing pass emits) skips most of
it: 34 µs against 56 µs for both products of ``1536 → 250 → 576`` at one row, and no slower at
512 rows (1.14 against 1.19 ms); outputs are bit for bit those of ``torch.mm``. The packed
tensor is an opaque oneDNN tensor the size of the factor it packs.

Example::

    right = torch.randn(576, 250, dtype=torch.bfloat16)   # (in, out), as x @ right
    if packable(right):
        y = packed_product(x, pack(right), None)           # == x @ right, x: (rows, 576)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["pack", "packable", "packed_product"]


def _supported() -> bool:
    """Whether this build and CPU run oneDNN's bfloat16 inner products (AVX-512 BF16 or AMX)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
        and mkldnn._is_mkldnn_bf16_supported()
    )


_SUPPORTED = _supported()
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if _SUPPORTED else None  # bound once: ~0.3 µs a call less


def packable(factor: Tensor) -> bool:
    """Whether ``factor`` ``(in, out)``, 2-D, can be prepacked: a bfloat16 CPU tensor on a CPU
    with native bfloat16 inner products. (oneDNN's float16 path needs AVX-512 FP16 or
    AVX-NE-CONVERT, and float32 calls have no such setup cost: MKL serves them.)"""
    return _SUPPORTED and factor.dtype == torch.bfloat16 and factor.device.type == "cpu" and factor.dim() == 2


def pack(factor: Tensor) -> Tensor:
    """``factor`` ``(in, out)`` packed for :func:`packed_product` (an opaque oneDNN tensor of
    shape ``(out, in)``, the ``nn.Linear`` layout), for products of one row (and as fast for many)."""
    return torch.ops.mkldnn._reorder_linear_weight(factor.detach().t().contiguous(), 1)


def packed_product(x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x @ factor (+ bias)`` for ``x`` ``(rows, in)`` and ``packed = pack(factor)``: ``(rows, out)``.
    No autograd; ``x`` and ``bias`` must have the factor's dtype (the caller checks)."""
    return _LINEAR(x, packed, bias, "none", [], "")
