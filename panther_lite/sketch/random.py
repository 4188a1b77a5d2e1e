"""Random-number plumbing shared by the sketching operators."""
from __future__ import annotations

import operator
from typing import Optional

import torch

__all__ = ["check_seed", "resolve_generator"]


def check_seed(seed) -> Optional[int]:
    """``seed`` as an int (any integer type, e.g. ``numpy.int64``), or None; TypeError
    for anything else (a float or a string would otherwise be truncated or misparsed)."""
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    try:
        return operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int or None, got {seed!r}") from None


def resolve_generator(seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Optional[torch.Generator]:
    """A CPU generator seeded with ``seed``, the given ``generator``, or None (global RNG).

    Operators draw on the CPU and then move to the target device, so one seed gives the
    same operator on every device.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    seed = check_seed(seed)
    if seed is not None:
        return torch.Generator(device="cpu").manual_seed(seed)
    return generator
