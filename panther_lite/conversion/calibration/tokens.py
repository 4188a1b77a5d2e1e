"""Real tokens: which positions of a calibration batch are data, so padding never enters a statistic.

A batch carrying an ``attention_mask`` ``(batch, seq)`` (a dict batch, the command's batches)
marks its padding with zeros. While such a batch runs (:func:`~panther_lite.conversion.calibration.batches.run_batch`
sets :func:`token_mask` for the duration), a layer whose input rows line up with the mask (an
input ``(batch, seq, fan_in)`` of a linear kind) has its padded rows zeroed and not counted
(:func:`layer_rows`); a layer whose input does not line up (cross-attention keys of another
length, a convolution) uses all its rows, and says so. Cached block calls carry the mask of the
batch they came from as a :class:`MaskedCall`.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

__all__ = [
    "MaskedCall", "LayerRows", "batch_token_mask", "token_mask", "current_token_mask", "layer_rows", "with_masks",
    "zero_padding", "UNALIGNED_NOTE",
]

UNALIGNED_NOTE = "its inputs do not line up with the batches' attention_mask, so all its input rows were used"
"""What the report says of a layer whose inputs a token mask could not be applied to."""

_CURRENT: ContextVar[Optional[Tensor]] = ContextVar("panther_lite_token_mask", default=None)


@dataclass(frozen=True)
class MaskedCall:
    """A calibration batch (a cached block call) with the token mask ``(batch, seq)`` (bool)
    of the batch it came from; :func:`~panther_lite.conversion.calibration.batches.run_batch`
    runs ``batch`` with ``mask`` as the current token mask."""

    batch: object
    mask: Optional[Tensor]


def batch_token_mask(batch) -> Optional[Tensor]:
    """The real-token mask ``(batch, seq)`` (bool) of a calibration batch: a dict batch's 2-D
    ``attention_mask``, a :class:`MaskedCall`'s mask; None otherwise (every row is data)."""
    if isinstance(batch, MaskedCall):
        return batch.mask
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def with_masks(calls: Sequence, masks: Sequence[Optional[Tensor]]) -> List[MaskedCall]:
    """``calls`` each paired with the mask of the batch it came from."""
    return [MaskedCall(call, mask) for call, mask in zip(calls, masks)]


@contextlib.contextmanager
def token_mask(mask: Optional[Tensor]) -> Iterator[None]:
    """``mask`` as the current token mask for the duration (None: every row is data)."""
    token = _CURRENT.set(mask)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_token_mask() -> Optional[Tensor]:
    return _CURRENT.get()


@dataclass
class LayerRows:
    """One call's input rows as a layer's kind reads them: ``chunks`` of ``(rows, rows per
    cluster)`` (padded rows zeroed), ``real``: per chunk the count of real rows in each cluster
    (an int64 tensor on the mask's device; None: every row is real), and ``unaligned``: a
    token mask was active but the input did not line up with it (all rows used)."""

    chunks: List[Tuple[Tensor, int]]
    real: List[Optional[Tensor]]
    unaligned: bool

    @property
    def count(self) -> int:
        """Real rows over the chunks."""
        return sum(int(r.sum()) if r is not None else rows.shape[0] for (rows, _), r in zip(self.chunks, self.real))


def layer_rows(kind, module: nn.Module, x: Tensor) -> LayerRows:
    """``x``'s rows as ``kind`` reads them, only the real tokens' (the rest zeroed) when the
    current token mask lines up with them (:meth:`~panther_lite.conversion.kinds.LayerKind.token_rows`)."""
    mask = current_token_mask()
    if mask is not None:
        masked = kind.token_rows(module, x, mask.to(x.device))
        if masked is not None:
            rows, per_cluster = masked
            return LayerRows([(rows, per_cluster)], [mask.reshape(-1, per_cluster).sum(1)], False)
    chunks = list(kind.input_rows(module, x))
    return LayerRows(chunks, [None] * len(chunks), mask is not None)


def zero_padding(output: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``output`` ``(batch, seq, ...)`` with its padded positions zeroed, when ``mask``
    ``(batch, seq)`` lines up with its leading dimensions; else ``output`` unchanged."""
    if mask is None or output.dim() < 3 or tuple(output.shape[:2]) != tuple(mask.shape):
        return output
    return torch.where(mask.to(output.device).reshape(*mask.shape, *(1,) * (output.dim() - 2)), output, 0)
