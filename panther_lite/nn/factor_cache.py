"""Cache of the concatenated factors ``[S1 | U2]`` and ``scale·[U1; S2]`` for no-grad eager calls.

An entry is keyed by the ``S1`` tensor object and holds weak references to the four
factors, so it lives no longer than ``S1`` and never outlives a replaced ``U``. It is
served only while every factor is the same tensor with the same storage, shape and
version counter and no optimizer has stepped since (fused optimizers do not move version
counters; :mod:`panther_lite.nn.change_detection` counts their steps): any in-place write
(``load_state_dict``, ``copy_``/``mul_`` under ``no_grad``), an optimizer step, ``.to()``,
or a new ``.data`` tensor invalidates it. Writes through ``param.data.<op>_()`` outside an
optimizer bypass the version counter (that is what ``.data`` is for): call
:func:`clear_factor_cache` after them.

An ``SKLinear`` keeps a reference to its entry after an eager no-grad call and tries it first
on the next (:meth:`CachedFactors.product`, which applies the same checks as the lookup);
:func:`clear_factor_cache` and the loss of ``S1`` release an entry's tensors, so a kept
reference never holds memory the cache has let go.

Memory: one copy of each layer's factors (its stored size) per layer run without grad. With
``packed=True`` (bfloat16 on CPU) the copy is held prepacked for oneDNN
(:mod:`~panther_lite.nn.onednn_packing`), the same size, instead of as plain concatenations.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from . import change_detection
from .factor_layout import LEFT, RIGHT, concatenated_factors
from .onednn_packing import pack, packed_product

__all__ = ["CachedFactors", "cached_factors", "clear_factor_cache", "concatenate_factors", "stacked_factors", "stacked_product"]


class CachedFactors:
    """One layer's cached ``left``/``right`` with what they were computed from. A layer may
    hold its entry to skip the lookup (:meth:`serves` checks it as the lookup would);
    :func:`clear_factor_cache` and the loss of ``S1`` release its tensors."""

    __slots__ = ("refs", "signature", "packed", "left", "right")

    def __init__(self, refs: Tuple[weakref.ref, ...], signature: tuple, packed: bool, left: Tensor, right: Tensor) -> None:
        self.refs, self.signature, self.packed, self.left, self.right = refs, signature, packed, left, right

    def serves(self, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, scale: float) -> bool:
        """Whether ``left``/``right`` are still those of these factors (inference tensors: never)."""
        if self.left is None:
            return False
        try:
            signature = _signature(S1, U1, U2, S2, scale)
        except RuntimeError:  # an inference tensor: "Inference tensors do not track version counter"
            return False
        if self.signature != signature:
            return False
        s1_ref, u1_ref, u2_ref, s2_ref = self.refs
        return s1_ref() is S1 and u1_ref() is U1 and u2_ref() is U2 and s2_ref() is S2

    def product(
        self, x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
    ) -> Optional[Tensor]:
        """``x·left·right (+ bias)`` while this entry serves these factors and the operands
        share the input's dtype, else None (also for a product that fails: another device,
        a wrong width), leaving the caller's general route to decide and raise."""
        if x.dtype != S1.dtype or (bias is not None and bias.dtype != x.dtype) or not self.serves(S1, U1, U2, S2, scale):
            return None
        try:
            return stacked_product(x, self.left, self.right, bias)
        except RuntimeError:
            return None

    def release(self) -> None:
        """Free the tensors; the entry serves nothing any more."""
        self.left = self.right = None


_CACHE: Dict[int, CachedFactors] = {}


def clear_factor_cache() -> None:
    """Drop every cached concatenation (they are rebuilt on the next no-grad call)."""
    for entry in _CACHE.values():
        entry.release()
    _CACHE.clear()


def _forget(key: int) -> None:
    entry = _CACHE.pop(key, None)
    if entry is not None:
        entry.release()


def stacked_product(x: Tensor, left: Tensor, right: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``(*, in) -> (*, out)``: ``x·left·right (+ bias)`` with the stacked factors of
    :func:`stacked_factors` (prepacked ones take the input's leading dimensions as they are)."""
    if left.is_mkldnn:
        return packed_product(packed_product(x, left, None), right, bias)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    hidden = torch.mm(rows, left)
    out = torch.mm(hidden, right) if bias is None else torch.addmm(bias, hidden, right)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _signature(S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, scale: float) -> tuple:
    """A lighter :func:`~panther_lite.nn.change_detection.tensor_signature` (this runs on
    every call): dtype and device changes always come with new storage."""
    return (
        change_detection._steps_seen, scale, S1._version, U1._version, U2._version, S2._version,
        S1.data_ptr(), U1.data_ptr(), U2.data_ptr(), S2.data_ptr(), S1.shape, S2.shape,
    )


def concatenate_factors(S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """``([S1 | U2], scale·[U1; S2])``, uncached and detached, stored as the factors are
    (:mod:`~panther_lite.nn.factor_layout`). The factors may carry leading (stack) dimensions:
    ``S1`` ``(*, in, R)`` gives ``left`` ``(*, in, 2R)`` and ``right`` ``(*, 2R, out)``."""
    with torch.no_grad():
        return concatenated_factors(S1, U2, LEFT), concatenated_factors(U1, S2, RIGHT).mul_(scale)


def stacked_factors(
    S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, scale: float, packed: bool = False
) -> Tuple[Tensor, Tensor]:
    """``([S1 | U2], scale·[U1; S2])`` of shapes ``(*, in, 2R)`` and ``(*, 2R, out)``, cached
    while the factors are unchanged, so ``y = (x·left)·right`` is two GEMMs whose products
    are already at the output's scale. ``packed`` (2-D bfloat16 CPU factors): both held
    prepacked by :func:`~panther_lite.nn.onednn_packing.pack` (``left.is_mkldnn``) for
    :func:`~panther_lite.nn.onednn_packing.packed_product`. Inference tensors (no version
    counter) are never cached, nor packed.

    Example::

        left, right = stacked_factors(S1, U1, U2, S2, scale)   # (in, 2R), (2R, out)
        y = x @ left @ right                                    # x (rows, in) -> (rows, out)
    """
    entry = cached_factors(S1, U1, U2, S2, scale, packed)
    return concatenate_factors(S1, U1, U2, S2, scale) if entry is None else (entry.left, entry.right)


def cached_factors(
    S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, scale: float, packed: bool = False
) -> Optional[CachedFactors]:
    """The cache's entry for these factors (see :func:`stacked_factors`), built on a miss;
    None for inference tensors, which are never cached."""
    key = id(S1)
    entry = _CACHE.get(key)
    if entry is not None and entry.packed == packed and entry.serves(S1, U1, U2, S2, scale):
        return entry
    try:
        signature = _signature(S1, U1, U2, S2, scale)
    except RuntimeError:  # an inference tensor: "Inference tensors do not track version counter"
        return None
    left, right = concatenate_factors(S1, U1, U2, S2, scale)
    if packed:
        left, right = pack(left), pack(right)
    if entry is not None:
        entry.release()
    refs = (weakref.ref(S1, lambda _: _forget(key)), weakref.ref(U1), weakref.ref(U2), weakref.ref(S2))
    entry = _CACHE[key] = CachedFactors(refs, signature, packed, left, right)
    return entry
