"""Fast Walsh–Hadamard transform and the entries of the Sylvester Hadamard matrix."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

__all__ = ["fwht", "hadamard_entries", "next_power_of_two"]


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    n = int(n)
    return 1 << (n - 1).bit_length()


def fwht(x: Tensor, *, normalized: bool = False) -> Tensor:
    r"""Walsh–Hadamard transform of ``x`` along its last dimension: ``x @ H_N`` (``H_N`` symmetric).

    ``H_N`` is the Sylvester Hadamard matrix, ``H_N[i, j] = (-1)^{popcount(i & j)}``
    (the ordering of :func:`scipy.linalg.hadamard`). The transform runs in
    ``log2(N)`` vectorised butterfly stages, each a reshape plus one add and one
    subtract over the whole tensor: ``O(N log N)`` work per row, no loop over elements.
    It is differentiable (its adjoint is itself).

    Args:
        x: ``(*, N)`` floating tensor with ``N`` a power of two.
        normalized: divide by ``√N`` so the transform is orthonormal (and an involution).

    Returns:
        ``(*, N)`` tensor of ``x``'s dtype and device.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"fwht expects a Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("fwht expects a tensor with at least one dimension, got a 0-d tensor")
    size = x.shape[-1]
    if size < 1 or size & (size - 1):
        raise ValueError(f"fwht needs the last dimension to be a power of two, got {size}")
    rows = x.reshape(-1, size)
    batch = rows.shape[0]
    half = 1
    while half < size:
        # Pairs (i, i + half) inside consecutive blocks of 2·half entries.
        blocks = rows.reshape(batch, size // (2 * half), 2, half)
        low, high = blocks[:, :, 0], blocks[:, :, 1]
        rows = torch.stack((low + high, low - high), dim=2)
        half *= 2
    out = rows.reshape(x.shape)
    return out / size**0.5 if normalized else out


def hadamard_entries(rows: Tensor, cols: Tensor, size: int) -> Tensor:
    """Entries ``H_N[rows[i], cols[j]] = (-1)^{popcount(rows[i] & cols[j])}`` of the Sylvester Hadamard matrix.

    Args:
        rows: ``(r,)`` integer tensor of row indices in ``[0, size)``.
        cols: ``(c,)`` integer tensor of column indices in ``[0, size)``, same device.
        size: ``N``, the order of the matrix, a power of two.

    Returns:
        ``(r, c)`` int64 tensor of ±1.
    """
    if next_power_of_two(size) != size:
        raise ValueError(f"size must be a power of two, got {size}")
    common = rows.to(torch.int64)[:, None] & cols.to(torch.int64)[None, :]
    parity = torch.zeros_like(common)
    for bit in range(size.bit_length() - 1):
        parity ^= (common >> bit) & 1
    return 1 - 2 * parity
