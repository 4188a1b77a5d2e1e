"""The memory distillation needs at least, and the check that refuses, before anything starts,
a model this machine's memory cannot train.

While :func:`~panther_lite.distill` trains, the whole student (parameters and buffers) is in
float32 (master weights, :mod:`~panther_lite.conversion.fitting.master_weights`) and each trained element has four more
float32 copies: the best parameters so far, the gradient and Adam's two moments. Activations and
the teacher (or its cache) come on top, so this is a floor: a model above it cannot train here,
and failing at once spares a conversion of hours ending in the system's out-of-memory kill.
"""
from __future__ import annotations

from ..physical_memory import physical_memory

__all__ = ["training_bytes", "check_training_memory"]

_FLOAT32 = 4
_COPIES_PER_TRAINED = 4  # the best parameters kept, the gradient, Adam's two moments


def training_bytes(elements: int, trained: int) -> int:
    """The least memory, in bytes, distilling a model of ``elements`` elements (parameters and buffers), of which
    ``trained`` train, holds at once.

    Examples:
        >>> training_bytes(elements=1000, trained=600)
        13600
    """
    return _FLOAT32 * (elements + _COPIES_PER_TRAINED * trained)


def _size(count: int) -> str:
    """``count`` bytes in the largest unit that leaves at least one (``1.5 GiB``, ``12.0 KiB``)."""
    power, unit = next((p, u) for p, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "bytes")) if count >= 2**p or not p)
    return f"{count / 2**power:,.1f} {unit}"


def check_training_memory(elements: int, trained: int, caller: str, remedy: str) -> None:
    """ValueError (naming ``caller``, the need, the machine's memory and ``remedy``) when the
    floor of :func:`training_bytes` exceeds this machine's physical memory; nothing where the
    system does not say how much it has."""
    total = physical_memory()
    needed = training_bytes(elements, trained)
    if total is not None and needed > total:
        copies = f"; for the {trained:,} that train, the best copy, the gradient and Adam's two moments" if trained else ""
        raise ValueError(
            f"{caller}: training this model needs at least {_size(needed)} (its {elements:,} elements in "
            f"float32{copies}), more than this machine's {_size(total)} of memory; {remedy}"
        )
