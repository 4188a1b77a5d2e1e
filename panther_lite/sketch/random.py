"""Random-number plumbing shared by the sketching operators."""
from __future__ import annotations

import operator
from typing import Optional

import torch

__all__ = ["check_seed", "resolve_generator"]


# torch.Generator.manual_seed accepts any integer that fits in 64 bits, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def check_seed(seed) -> Optional[int]:
    """``seed`` as an int (any integer type, e.g. ``numpy.int64``), or None; TypeError
    for anything else (a float or a string would otherwise be truncated or misparsed),
    ValueError for an integer outside ``[-2**63, 2**64 - 1]`` (what a 64-bit seed holds)."""
    if seed is None:
        return None
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int or None, got {seed!r}") from None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must fit in 64 bits (between -2**63 and 2**64 - 1), got {seed}")
    return seed


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
